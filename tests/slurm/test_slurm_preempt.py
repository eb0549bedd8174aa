"""A low-priority training job is preempted by a high-priority one on a real Slurm: it
checkpoints at its next safepoint, is requeued, resumes, and ends bitwise equal to an
uninterrupted run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # slow: runs first (tests/conftest.py)

STEPS, STEP_TIME = 300, 0.03
REPO_SRC = str(Path(__file__).resolve().parents[2] / "src")
HELD_TRAIN = Path(__file__).resolve().parents[1] / "held_train.py"

# The demo training, held at its safepoints from step STEPS/2 on until the test creates {gate}
# (tests/held_train.py): it cannot finish before Slurm has preempted or cancelled it, however slow
# the machine; a requeued run restarts below STEPS/2 + 1 and so still has steps to run.
SCRIPT = """#!/bin/bash
echo "batch: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"
exec {launcher}{python} {held} {gate} {hold_at} --steps {steps} --step-time {step_time} --log-every 10 --out {out}
"""


def _script(launcher: str, gate: Path, out: Path) -> str:
    return SCRIPT.format(launcher=launcher, python=sys.executable, held=HELD_TRAIN, gate=gate, hold_at=STEPS // 2,
                         steps=STEPS, step_time=STEP_TIME, out=out)


def _train_env(extra: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    env = dict(base, PYTHONPATH=os.pathsep.join(filter(None, [REPO_SRC, os.environ.get("PYTHONPATH")])))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("baseline") / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUSWAP_"))}
    subprocess.run([sys.executable, "-m", "gpuswap.demo.train", "--steps", str(STEPS), "--out", str(out)],
                   env=_train_env({}, env), check=True, capture_output=True, timeout=120)
    return json.loads(out.read_text())


def _wait_output(path: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.2)
    raise TimeoutError(f"{needle!r} never appeared in {path}:\n{text}")


@pytest.mark.parametrize("mode", ["user-signal", "sigterm", "slurm-wrap"])
def test_preempted_job_requeues_and_resumes_exactly(slurm, baseline, tmp_path: Path, mode: str) -> None:
    """user-signal: `--signal=B:USR2@..` + preempt_send_user_signal; the job runs
    `scontrol requeue` itself. sigterm: no --signal, so preemption sends SIGTERM to the srun task
    at the start of GraceTime; the job only exits 75 and leaves the requeue to Slurm.
    slurm-wrap: as user-signal, but the batch shell is `gpuswap slurm-wrap`, which forwards the
    signal to the training process and exits with its code."""
    out, log = tmp_path / "result.json", tmp_path / "low.out"
    script = tmp_path / "train.sh"
    if mode == "user-signal":  # the batch shell itself becomes python and gets the signal
        opts, extra, launcher = ["--signal=B:USR2@300"], {}, ""
    elif mode == "slurm-wrap":  # B: signals only the batch shell: the wrapper forwards it
        opts, extra = ["--signal=B:USR2@300"], {}
        launcher = f"{sys.executable} -m gpuswap.cli.main slurm-wrap -- "
    else:  # preemption's first SIGTERM goes to the job's tasks: run training as an srun task
        opts, extra, launcher = [], {"GPUSWAP_SLURM_REQUEUE": "exit"}, "srun --kill-on-bad-exit=0 "
    gate = tmp_path / "go"
    script.write_text(_script(launcher, gate, out))
    env = _train_env(extra, slurm.env)
    low = slurm.sbatch("-p", "low", "-t", "10", "--requeue", "--open-mode=append", "-o", str(log),
                       *opts, str(script), cwd=tmp_path, env=env)
    _wait_output(log, f"step 30/{STEPS}", timeout=120)  # attached and training
    high = slurm.sbatch("-p", "high", "-t", "1", "-o", str(tmp_path / "high.out"),
                        "--wrap", "echo high ran; sleep 1", cwd=tmp_path, env=env)

    slurm.wait_state(high, ("COMPLETED",), timeout=120)
    gate.touch()
    info = slurm.wait_state(low, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=150)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED", (info, text, slurm.logs())
    assert info["ExitCode"] == "0:0"
    assert int(info["Restarts"]) >= 1, info
    sig = "SIGTERM" if mode == "sigterm" else "SIGUSR2"
    assert f"got {sig} from Slurm" in text, text
    if mode == "slurm-wrap":
        assert "slurm-wrap: forwarding SIGUSR2" in text, text
    if mode != "sigterm":
        assert f"requeued Slurm job {low}" in text, text
    assert "batch: job %s restart 1" % low in text, text
    result = json.loads(out.read_text())
    assert 0 < result["start_step"] < STEPS, result  # resumed from the checkpoint, not from 0
    assert f"train: resuming at step {result['start_step']}" in text
    assert result["sha256"] == baseline["sha256"], (result, baseline)
    assert "high ran" in (tmp_path / "high.out").read_text()
    ckpts = sorted((tmp_path / ".gpuswap" / "ckpt" / low).glob("ckpt-*.json"))
    assert ckpts, "no checkpoint in the documented default directory"
    manifest = json.loads(ckpts[-1].read_text())
    assert manifest["job_id"] == low and manifest["step"] == result["start_step"] - 1


def test_scancel_is_not_turned_into_a_requeue(slurm, tmp_path: Path) -> None:
    """scancel also sends SIGTERM: the job checkpoints, but must stay cancelled."""
    log, script = tmp_path / "job.out", tmp_path / "train.sh"
    script.write_text(_script("", tmp_path / "never", tmp_path / "result.json"))   # held until cancelled
    job = slurm.sbatch("-p", "low", "-t", "10", "--requeue", "-o", str(log), str(script),
                       cwd=tmp_path, env=_train_env({}, slurm.env))
    _wait_output(log, f"step 30/{STEPS}", timeout=120)
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    text = _wait_output(log, "not requeueing it", timeout=180)
    # Until the job has ended on the node Slurm shows it COMPLETING (not CANCELLED): while any
    # process of it is alive to call `scontrol requeue`, and until the batch script's exit is
    # recorded (75, which RequeueExit=75 would requeue: the requeue happens right there). So once
    # it is CANCELLED with that exit recorded, a wrong requeue would already show (PENDING, a restart).
    info = slurm.wait_state(job, ("CANCELLED",), timeout=180)
    assert info["ExitCode"] == "75:0" and info["Restarts"] == "0", (info, text)
    assert "got SIGTERM from Slurm" in text
