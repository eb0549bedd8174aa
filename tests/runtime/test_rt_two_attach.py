"""A script that attaches twice (pretraining then fine-tuning, two `fit()` calls), parked to disk in
one phase and restarted: each checkpoint is restored only by the attach of the number that wrote
it (checkpoint.other_attach). Real processes under a fake Slurm job (the runtime checkpoints on
SIGUSR2 and exits 75; the rerun with SLURM_RESTART_COUNT=1 restores), as tests/slurm does.

Before the attach number was recorded, every attach restored the newest checkpoint: parked in
phase 2, the restart's *first* attach loaded phase 2's model and optimizer into phase 1's objects
(same shapes, so nothing refused it) and trained them on from phase 2's step; parked in phase 1,
the second attach loaded phase 1's state into phase 2's fresh model. Both silently.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.runtime import checkpoint, rankstate
from gpuswap.runtime.objects import classify

SRC = str(Path(__file__).resolve().parents[2] / "src")

TWO_PHASES = """
import hashlib, json, os, signal, sys, time
import torch
import gpuswap

torch.manual_seed(0)
torch.set_num_threads(1)
park = os.environ.get("PARK")            # "phase:step": Slurm's preemption signal there
park_at = tuple(int(x) for x in park.split(":")) if park else None
data, target = torch.randn(64, 4), torch.randn(64, 4)


def phase(n, model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    job = gpuswap.attach(model=model, opt=opt, seen=0)
    print(f"phase {n}: start_step {job.start_step}", flush=True)
    for step in range(job.start_step, steps):
        idx = torch.randint(0, 64, (8,))            # the RNG: restored with the phase's checkpoint
        out = torch.nn.functional.dropout(model(data[idx]), 0.2)
        loss = torch.nn.functional.mse_loss(out, target[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        job.state["seen"] += len(idx)
        if (n, step) == park_at:
            os.kill(os.getpid(), signal.SIGUSR2)
            deadline = time.monotonic() + 120       # the fact: the pause is asked for (no timing window)
            while not job._pending and time.monotonic() < deadline:
                time.sleep(0.001)
        job.safepoint(step)
    return model, job.state["seen"]


a, seen_a = phase(1, torch.nn.Linear(4, 4), 12)     # same shapes in both phases: the dangerous case
b, seen_b = phase(2, torch.nn.Linear(4, 4), 12)
digest = {name: hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()
          for name, t in (("a.weight", a.weight), ("a.bias", a.bias), ("b.weight", b.weight), ("b.bias", b.bias))}
print("RESULT " + json.dumps({"params": digest, "seen": [seen_a, seen_b],
                              "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()}), flush=True)
"""


def _run(tmp: Path, slurm: bool, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    if slurm:
        env.update(SLURM_JOB_ID="31", SLURM_SUBMIT_DIR=str(tmp), GPUSWAP_SLURM_REQUEUE="exit")
    script = env_extra.pop("SCRIPT", TWO_PHASES)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp, capture_output=True, text=True,
                          timeout=180)


def _result(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same script outside gpuswap: what every resumed run must end with, bitwise."""
    return _result(_run(tmp_path_factory.mktemp("plain"), slurm=False))


@pytest.mark.parametrize("phase", [1, 2])
def test_a_disk_park_in_either_phase_resumes_that_phase_exactly(tmp_path: Path, phase: int,
                                                                 uninterrupted: dict) -> None:
    parked = _run(tmp_path, slurm=True, PARK=f"{phase}:5")
    assert parked.returncode == REQUEUE_EXIT_CODE, (parked.returncode, parked.stderr[-3000:])
    manifests = list((tmp_path / ".gpuswap" / "ckpt" / "31").glob("ckpt-*.json"))
    assert len(manifests) == 1
    manifest = json.loads(manifests[0].read_text())
    assert manifest["step"] >= 5

    resumed = _run(tmp_path, slurm=True, SLURM_RESTART_COUNT="1")
    assert _result(resumed) == uninterrupted          # both models, job.state, and the RNG after it all
    assert manifest.get("attach") == phase            # which attach wrote it
    step = manifest["step"]
    if phase == 2:     # the first phase had finished before the park: it runs again, and says why
        assert f"phase 1: start_step 0\n" in resumed.stdout
        assert f"phase 2: start_step {step + 1}\n" in resumed.stdout
        assert (f"gpuswap: attach 1 of this process does not restore checkpoint seq {manifest['seq']} "
                f"(step {step}): attach 2 wrote it") in resumed.stderr
    else:              # the second phase had not begun: it starts afresh, and says why
        assert f"phase 1: start_step {step + 1}\n" in resumed.stdout
        assert "phase 2: start_step 0\n" in resumed.stdout
        assert (f"gpuswap: attach 2 of this process starts from step 0: checkpoint seq {manifest['seq']} "
                f"(step {step}) was written by attach 1, which has finished since") in resumed.stderr
    assert resumed.stderr.count("gpuswap: restored checkpoint") == 1
    assert "no usable checkpoint" not in resumed.stderr      # Slurm's restart line is not misled


def test_the_attach_number_and_what_an_unnumbered_checkpoint_counts_as(tmp_path: Path) -> None:
    assert checkpoint.attach_of({"attach": 3}) == 3
    assert checkpoint.attach_of({}) == 1                       # written before numbers: a first attach's
    assert checkpoint.attach_of({"attach": "2"}) == 1 and checkpoint.attach_of({"attach": 0}) == 1
    assert checkpoint.other_attach(2, 2, 7, 40) is None
    assert "runs again from step 0" in checkpoint.other_attach(2, 1, 7, 40)
    assert "starts from step 0" in checkpoint.other_attach(1, 2, 7, 40)
    info = checkpoint.write_checkpoint(tmp_path, {"format": checkpoint.FORMAT, "step": 4, "attach": 2}, 4)
    assert info.attach == 2 and checkpoint.list_checkpoints(tmp_path)[0].attach == 2


def test_a_rank_restores_only_a_checkpoint_of_its_attach(tmp_path: Path) -> None:
    """The multi-rank restore decides as the single-rank one: parts written by attach 2 are not
    loaded into attach 1's objects, and attach 2 restores them."""
    import torch

    from gpuswap.runtime import ckparts

    src = torch.nn.Linear(3, 3)
    payload = rankstate.part_payload([classify("model", src)], {"seen": 9}, rank=0, world_size=1, step=6, tick=6,
                                     job_id=None, to_host=lambda t: t.detach().cpu(), attach=2)
    ckparts.write_manifest(tmp_path, [ckparts.write_part(tmp_path, payload)], step=6, tick=6, world_size=1,
                           attach=2)
    first, state = torch.nn.Linear(3, 3), {}
    before = first.weight.detach().clone()
    done = rankstate.restore_latest(str(tmp_path), None, [classify("model", first)], state, 0, 1, attach_no=1)
    assert done.step is None and done.checkpoint_of == 2 and "attach 2 wrote it" in (done.note or "")
    assert torch.equal(first.weight, before) and state == {}
    second = torch.nn.Linear(3, 3)
    done = rankstate.restore_latest(str(tmp_path), None, [classify("model", second)], state, 0, 1, attach_no=2)
    assert done.step == 6 and done.checkpoint_of is None and state == {"seen": 9}
    assert torch.equal(second.weight, src.weight)


# The same two phases, but the script skips phase 1 once it has finished (a marker file, as a
# script that saves its pretrained weights and loads them on a restart would), and phase 2's
# model has another shape. After a park in phase 2 the restart's first attach is phase 2's.
SKIPPING = TWO_PHASES.replace(
    "a, seen_a = phase(1, torch.nn.Linear(4, 4), 12)     # same shapes in both phases: the dangerous case\n",
    "if os.path.exists('phase1.done'):\n"
    "    a, seen_a = torch.nn.Linear(4, 4), None\n"
    "else:\n"
    "    a, seen_a = phase(1, torch.nn.Linear(4, 4), 12)\n"
    "    open('phase1.done', 'w').close()\n",
).replace("b, seen_b = phase(2, torch.nn.Linear(4, 4), 12)", "b, seen_b = phase(2, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), 12)")
SKIPPING = SKIPPING.replace('("b.weight", b.weight), ("b.bias", b.bias)', '("b.weight", b[1].weight), ("b.bias", b[1].bias)')


def test_a_restart_that_skips_the_finished_phase_resumes_the_parked_one(tmp_path: Path) -> None:
    """Recording only the attach number made such a script lose the parked phase on every restart:
    its first attach (phase 2's) met a checkpoint of attach 2 and ran again from step 0. A
    checkpoint now also keeps what each attach of its process attached (objects.signature), and an
    attach that matches its checkpoint's attach and no earlier one resumes it (pausing.skipped_to)."""
    assert SKIPPING != TWO_PHASES and "phase1.done" in SKIPPING and "b[1].weight" in SKIPPING
    plain = tmp_path / "plain"
    plain.mkdir()
    reference = _result(_run(plain, slurm=False, SCRIPT=SKIPPING))
    parked = _run(tmp_path, slurm=True, PARK="2:5", SCRIPT=SKIPPING)
    assert parked.returncode == REQUEUE_EXIT_CODE, (parked.returncode, parked.stderr[-3000:])
    [manifest] = [json.loads(m.read_text()) for m in (tmp_path / ".gpuswap" / "ckpt" / "31").glob("ckpt-*.json")]
    assert manifest["attach"] == 2
    resumed = _run(tmp_path, slurm=True, SLURM_RESTART_COUNT="1", SCRIPT=SKIPPING)
    r = _result(resumed)
    assert "phase 1" not in resumed.stdout and f"phase 2: start_step {manifest['step'] + 1}\n" in resumed.stdout
    assert "attach 1 of this process is attach 2 of the run that wrote checkpoint" in resumed.stderr
    assert {k: v for k, v in r["params"].items() if k.startswith("b.")} == \
        {k: v for k, v in reference["params"].items() if k.startswith("b.")}
    assert r["seen"][1] == reference["seen"][1] and r["rng"] == reference["rng"]


def test_an_attach_like_an_earlier_one_is_not_taken_for_a_skipped_phase() -> None:
    """Where the checkpoint's attach attached what an earlier attach did too (same names, shapes,
    dtypes), nothing tells a rerun of the earlier phase from a skip to the later one: the earlier
    phase's rerun is the safe reading (never another phase's state in its objects)."""
    import torch

    from gpuswap.runtime import pausing
    from gpuswap.runtime.handle import Job
    from gpuswap.runtime.objects import signature

    one, other = signature([classify("model", torch.nn.Linear(4, 4))], ["seen"]), \
        signature([classify("model", torch.nn.Linear(4, 3))], ["seen"])
    assert one == signature([classify("model", torch.nn.Linear(4, 4))], ["seen"]) and one != other
    job = Job.__new__(Job)
    job.attach_no, job.attach_sigs = 1, (other,)
    assert pausing.skipped_to(job, {"attaches": [one, other]}, 2)          # phase 1 skipped: phase 2's
    job.attach_sigs = (one,)
    assert not pausing.skipped_to(job, {"attaches": [one, other]}, 2)      # phase 1 again
    job.attach_sigs = (one,)
    assert not pausing.skipped_to(job, {"attaches": [one, one]}, 2)        # alike: phase 1 again
    assert not pausing.skipped_to(job, {"attach": 2}, 2)                   # written before signatures
