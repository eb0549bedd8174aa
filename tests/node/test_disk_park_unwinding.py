"""What runs while a disk park unwinds the job (SystemExit 75 after the checkpoint): a framework's
teardown or a `finally:` that reads the model. On an H100, Lightning's teardown (it moves the
optimizer's state to the CPU) failed with "CUDA error: invalid argument" because the park had
freed the device memory first, and the job exited 1 instead of 75. Now a disk park keeps the
device memory until the process is gone, and a job that still fails while unwinding, after its
checkpoint is committed, is requeued from it all the same, with the exit noted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: pip install 'gpuswap[torch]'")

# argv: mode (ok | fail | swallow), steps, gate: the job holds at step 5 until the gate exists.
# fail: a teardown that raises; swallow: a script that catches the SystemExit and trains on.
SCRIPT = """
import hashlib, os, sys, time, torch, gpuswap
mode, steps, gate = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
job = gpuswap.attach(model=model, optimizer=opt)
g = torch.Generator().manual_seed(1)
xs = [torch.randn(4, 16, generator=g) for _ in range(steps)]
def train(step):
    opt.zero_grad()
    model(xs[step]).pow(2).mean().backward()
    opt.step()
cur = job.start_step
try:
    for step in range(job.start_step, steps):
        cur = step
        train(step)
        job.safepoint(step)
        while step == 5 and not os.path.exists(gate):
            time.sleep(0.02)
            job.safepoint(step)
except SystemExit as e:
    print("UNWIND", float(model.weight.sum()), flush=True)     # a teardown reads the model
    if mode == "fail" and e.code == 75:
        raise RuntimeError("the framework's teardown failed")
    if mode != "swallow":
        raise
    for step in range(cur + 1, steps):
        train(step)
print("HASH", hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
      flush=True)
"""


def _lines(text: str, tag: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(tag + " ")]


@pytest.fixture(scope="module")
def outside() -> subprocess.CompletedProcess:
    """The script run outside gpuswap, uninterrupted (mode ok, 12 steps): the reference every test
    compares its job's final parameters with. Deterministic and the same for all three, so made
    once (it was made by each test: a torch process of ~2 s)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    run = subprocess.run([sys.executable, "-c", SCRIPT, "ok", "12", "/"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_a_disk_park_unwinds_with_whole_tensors_and_requeues_even_if_unwinding_fails(daemon, outside, mode):
    gate = daemon.home / "go"
    job = daemon.submit([sys.executable, "-c", SCRIPT, mode, "12", str(gate)], name=f"unwind-{mode}")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and j["step"] == 5)
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0
    parked = daemon.until(job, lambda j: j["state"] in ("PAUSED", "FAILED", "COMPLETED") and j["parked"] != "ram")
    assert parked["state"] == "PAUSED" and parked["parked"] == "disk", parked
    said = [e["reason"] for e in parked["events"] if e["reason"].startswith("parked to disk")]
    unwound = "exited with code 1 while unwinding, after its checkpoint"
    assert len(said) == 1 and (unwound in said[0]) == (mode == "fail"), said
    gate.touch()
    assert daemon.cli("resume", str(job)).returncode == 0
    done = daemon.state(job, "COMPLETED")
    assert done["exit_code"] == 0
    log = daemon.cli("logs", str(job)).stdout
    assert len(_lines(log, "UNWIND")) == 1                   # the model was whole while unwinding
    assert _lines(log, "HASH") == _lines(outside.stdout, "HASH")


def test_a_job_that_catches_the_requeue_and_trains_to_its_end_is_completed(daemon, outside):
    """Exit 0 after the checkpoint is the job's own word that it finished: COMPLETED, not
    requeued (it would train its last steps twice)."""
    gate = daemon.home / "go"
    job = daemon.submit([sys.executable, "-c", SCRIPT, "swallow", "12", str(gate)], name="swallow")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and j["step"] == 5)
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0
    done = daemon.until(job, lambda j: j["state"] in ("PAUSED", "FAILED", "COMPLETED"))
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0, done
    assert not any(e["reason"].startswith("parked to disk") for e in done["events"])
    log = daemon.cli("logs", str(job)).stdout
    assert _lines(log, "HASH") == _lines(outside.stdout, "HASH")
