"""On a real GPU (skipped without one): the daemon's two ways of parking a job, checked with NVML.

Cooperative: a training job with ~2.3 GiB of state (151 M parameters; weights, gradients and two
AdamW moments are 16 bytes each), far above a CUDA context, is parked in RAM by a policy
preemption. While parked, NVML must show its process down to the *floor*: what the same program
holds on the GPU with almost no state. The floor is measured in the test, not assumed: the same
demo program at hidden width 64 (0.1 MiB of state), held after a few steps in a separate process,
as NVML shows it. It holds everything a parked job keeps and cannot give back: the CUDA context,
the kernels the program loaded (lazy loading adds them as they are first used), cuBLAS
workspaces and the caching allocator's few small blocks of the data tensors. A bare
`torch.zeros(1, device="cuda")` process would miss the kernels and workspaces and make a correct
park look like a leak; a fixed number would not hold across drivers and GPUs. The parked job may
exceed the floor by FLOOR_MARGIN (other GEMM kernels for the larger shapes): a park that kept
even a tenth of the state would not pass. The job then resumes bitwise-exactly: its final
parameters equal those of an uninterrupted run on CUDA.

Transparent: an unmodified CUDA script (no gpuswap import) started under `sh -c`, so its CUDA
process is the shell's child, is frozen through the driver by `gpuswap pause` and by a policy
preemption. NVML then lists none of the job's processes; thawed, the same process is back on the
GPU and the job ends with the hash of an uninterrupted run. Skipped, with the daemon's own reason,
where the driver path is unavailable (`gpuswap gpus`: the transparent capability).

NVML must list processes under this machine's pids (a container without the host's pid
namespace does not): checked on a probe process first, else the tests skip and say so.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from gpuswap_testing import Gate, reference_env

pytestmark = pytest.mark.gpu

MiB, GiB = 2**20, 2**30
FLOOR_MARGIN = 256 * MiB
BIG_HIDDEN = 12288           # 16 B x 12288^2 = 2.25 GiB of state


@pytest.fixture(autouse=True)
def _cuda_torch() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install 'gpuswap[torch]'")
    if not torch.cuda.is_available():
        pytest.skip("this torch cannot use the GPU (a CPU-only build, or no CUDA runtime)")


def _tree(pid: int) -> set[int]:
    import psutil

    try:
        return {pid} | {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {pid}


def _nvml_used(pids: set[int]) -> Optional[int]:
    """Device bytes NVML reports for these processes on all GPUs, or None if it lists none of them."""
    import pynvml

    pynvml.nvmlInit()
    listed, total = False, 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
            if p.pid in pids:
                listed = True
                total += p.usedGpuMemory or 0
    return total if listed else None


def _nvml_pids(pids: set[int]) -> set[int]:
    """Those of `pids` that NVML lists as compute processes on any GPU."""
    import pynvml

    pynvml.nvmlInit()
    return {p.pid for i in range(pynvml.nvmlDeviceGetCount())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i))
            if p.pid in pids}


def _gpu_count() -> int:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetCount()


def _job_pid(home: Path, job_id: int, generation: int = 1) -> int:
    return json.loads((home / "jobs" / str(job_id) / f"run-{generation}" / "status.json").read_text())["job_pid"]


def _floor(tmp: Path) -> int:
    """NVML's figure for the demo program at hidden width 64, held on the GPU after 6 steps: a
    context, the program's kernels and workspaces, next to no state (see the module docstring)."""
    gate = Gate(tmp / "floor.go")
    cmd = gate.train(tmp / "floor.json", steps=10, step_time=0.0, hidden=64, hold_at=5) + ["--log-every", "1"]
    proc = subprocess.Popen(cmd, env=reference_env(simulated=False), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:          # printed just before the safepoint that holds
            if line.startswith("train: step 6/10"):
                break
        else:
            raise AssertionError(f"the floor probe ended early ({proc.wait()})")
        used = _nvml_used({proc.pid})
    finally:
        gate.open()
        proc.communicate(timeout=300)
    if used is None:
        pytest.skip("NVML does not list this test's own CUDA process under its pid (a container "
                    "without the host's pid namespace?): the daemon cannot find CUDA processes here")
    if used == 0:
        pytest.skip("NVML reports no per-process memory here (usedGpuMemory unavailable)")
    return used


def test_cuda_job_parked_in_ram_releases_memory_down_to_the_floor_and_resumes_exactly(make_daemon, home,
                                                                                         reference_hashes):
    floor = _floor(home)
    reference = reference_hashes(300, BIG_HIDDEN, simulated=False)   # asserts it ran on CUDA
    d = make_daemon("--min-runtime", "1")
    gate, urgent_gate = Gate(home / "long.go"), Gate(home / "urgent.go")
    # Held at its safepoints from step 298 until the gate opens: it cannot end before it is parked.
    long_id = d.submit(gate.train(home / "long.json", 300, 0.01, BIG_HIDDEN), name="long", priority="low",
                       gpus=_gpu_count())
    d.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) > 10, timeout=300)
    pid = _job_pid(home, long_id)
    before = _nvml_used(_tree(pid))
    assert before is not None and before - floor >= 2 * GiB, (before, floor)   # the state dominates
    # The urgent job holds its GPU until NVML has been read.
    urgent = d.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    parked = d.until(long_id, lambda j: j["state"] == "PAUSED", timeout=300)
    during = _nvml_used(_tree(pid))
    print(f"NVML: floor {floor / MiB:.0f} MiB, {before / MiB:.0f} MiB before the park, "
          f"{(during or 0) / MiB:.0f} MiB while parked ({parked['parked_bytes'] / MiB:.0f} MiB parked)")
    assert parked["parked"] == "ram" and parked["mechanism"] == "cooperative"
    assert parked["parked_bytes"] >= 2 * GiB                   # the runtime's own count of what it moved
    assert during is not None, "the parked job keeps its context: NVML still lists it"
    assert during <= floor + FLOOR_MARGIN, (during, floor)     # everything but what a context-sized run holds
    urgent_gate.open()
    assert d.cli("wait", str(urgent)).returncode == 0
    d.until(long_id, lambda j: j["state"] == "RUNNING" and j["parked"] is None, timeout=300)
    gate.open()
    assert d.state(long_id, "COMPLETED", timeout=300)["exit_code"] == 0
    result = json.loads((home / "long.json").read_text())
    assert result["device"] == "cuda" and result["sha256"] == reference


# An unmodified CUDA program: no gpuswap import. 2 x 8192^2 parameters with gradients and two AdamW
# moments: 2.0 GiB of state. It trains on; from step HOLD_AT on it waits for the gate, so it cannot
# end before the test has frozen and thawed it (it is frozen wherever it is then: mid-training or
# waiting). Its data and dropout come from the CUDA generator, whose state the freeze must keep.
UNMODIFIED = """import hashlib, json, os, sys, time
import torch
out, steps, hold_at, gate, ready = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
hidden = 8192
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(hidden, hidden)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(steps):
    while step >= hold_at and not os.path.exists(gate):
        time.sleep(0.05)
    x = torch.randn(64, hidden, device="cuda")
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        torch.cuda.synchronize()
        open(ready, "w").close()
h = hashlib.sha256()
for name, t in model.state_dict().items():
    h.update(name.encode())
    h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
with open(out, "w") as f:
    json.dump({"sha256": h.hexdigest(), "loss": loss.item()}, f)
"""
STEPS, HOLD_AT = 400, 398


def _unmodified(home: Path, tag: str, gate: Gate) -> tuple[list[str], Path, Path]:
    """(argv of the script, its result file, the file it makes once its state is on the GPU)."""
    script = home / "unmodified.py"
    script.write_text(UNMODIFIED)
    out, ready = home / f"{tag}.json", home / f"{tag}.ready"
    return [sys.executable, str(script), str(out), str(STEPS), str(HOLD_AT), str(gate.path), str(ready)], out, ready


@pytest.mark.parametrize("how", ["pause", "preempt"])
def test_unmodified_cuda_child_of_a_shell_is_frozen_by_the_driver_and_thawed_exactly(make_daemon, home, how):
    d = make_daemon("--min-runtime", "1")
    cap = d.client.get("/v1/gpus")["transparent"]      # what `gpuswap gpus` shows
    if not cap["available"]:
        pytest.skip(f"transparent parking is unavailable here: {cap['description']}")
    # The uninterrupted run, outside gpuswap, on CUDA.
    ref_gate = Gate(home / "ref.go")
    ref_gate.open()
    argv, ref_out, _ = _unmodified(home, "ref", ref_gate)
    subprocess.run(argv, env=reference_env(simulated=False), check=True, timeout=300)
    reference = json.loads(ref_out.read_text())["sha256"]
    gate, urgent_gate = Gate(home / "go"), Gate(home / "urgent.go")
    argv, out, ready = _unmodified(home, "job", gate)
    # `; echo end` keeps sh from exec'ing python: the CUDA process is the shell's child.
    job = d.submit(["sh", "-c", f"{shlex.join(argv)}; echo end"], name="plain", priority="low",
                   gpus=_gpu_count() if how == "preempt" else 1)
    d.until(job, lambda j: ready.exists() or j["state"] not in ("PENDING", "RUNNING"), timeout=300)
    assert ready.exists(), d.job(job)
    shell = _job_pid(home, job)
    cuda = _nvml_pids(_tree(shell))
    if not cuda:
        pytest.skip("NVML does not list the job's CUDA process under its pid (a container without the "
                    "host's pid namespace?): the daemon cannot find CUDA processes here")
    [cuda_pid] = cuda
    assert cuda_pid != shell                                        # the shell's child, as with `bash run.sh`
    before = _nvml_used({cuda_pid}) or 0
    assert before >= 2 * GiB, before

    if how == "pause":
        assert d.cli("pause", str(job)).returncode == 0
    else:
        urgent = d.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    j = d.until(job, lambda j: j["state"] == "PAUSED" or "cannot freeze" in j["reason"], timeout=300)
    assert j["state"] == "PAUSED", j["reason"]
    assert j["mechanism"] == "transparent" and j["parked"] == "ram", j
    assert "frozen transparently" in j["reason"] and str(cuda_pid) in j["reason"], j["reason"]
    # Measured by the daemon before the lock: NVML's footprint, not a declared size (none was).
    assert 2 * GiB <= j["parked_bytes"] <= before + FLOOR_MARGIN, (j["parked_bytes"], before)
    assert _nvml_pids(_tree(shell)) == set()                       # after the checkpoint NVML lists none of it
    assert d.client.get("/v1/gpus")["ram_parked"] == j["parked_bytes"]

    if how == "pause":
        assert d.cli("resume", str(job)).returncode == 0
    else:
        d.state(urgent, "RUNNING", timeout=300)                    # the GPU went to the urgent job
        urgent_gate.open()
        assert d.cli("wait", str(urgent)).returncode == 0
    j = d.until(job, lambda j: (j["state"] == "RUNNING" and j["parked"] is None) or j["state"] == "FAILED",
                timeout=300)
    assert j["state"] == "RUNNING", j["reason"]
    assert any(e["reason"].startswith("thawed") for e in j["events"]), j["events"]
    assert _nvml_pids(_tree(shell)) == {cuda_pid}                  # the same process, back on the GPU
    gate.open()
    done = d.state(job, "COMPLETED", "FAILED", timeout=300)
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0, done["reason"]
    assert d.cli("logs", str(job)).stdout.rstrip().endswith("end")
    assert json.loads(out.read_text())["sha256"] == reference
    assert d.client.get("/v1/gpus")["ram_parked"] == 0
