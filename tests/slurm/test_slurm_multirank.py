"""A 2-rank DDP job (gloo, CPU) on a real Slurm, preempted by a high-priority job: every rank
checkpoints at one common step, the job requeues, every rank restores, and each ends bitwise equal
to an uninterrupted run (docs/design/multi-rank.md section 9). Two launch forms:

torchrun: `exec gpuswap slurm-wrap -- torchrun --nproc-per-node 2 ...` with `--signal=B:USR2`; the
wrapper gets the signal, coordinates the ranks, requeues the job and exits 75.
srun: `srun --ntasks 2 python ...`, each task a rank; preemption's SIGTERM reaches every task, rank 0
runs the coordinator on a thread and requeues the job.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from test_slurm_preempt import _train_env, _wait_output  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multirank"))
from mr_testing import assert_bitwise  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.slow]   # slow: runs first (tests/conftest.py)

STEPS, HOLD_AT = 40, 20
JOB = Path(__file__).with_name("mr_train.py")
FREE_PORT = "$({py} -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])')"
SCRIPTS = {
    "torchrun": """#!/bin/bash
echo "batch: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"
exec {py} -m gpuswap.cli.main slurm-wrap -- {py} -m torch.distributed.run --standalone --nproc-per-node 2 \\
    {job} --steps {steps} --hold-at {hold} --out {out}
""",
    "srun": """#!/bin/bash
echo "batch: job $SLURM_JOB_ID restart ${{SLURM_RESTART_COUNT:-0}}"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=""" + FREE_PORT + """
srun --kill-on-bad-exit=0 {py} {job} --steps {steps} --hold-at {hold} --out {out}
""",
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same training under plain torchrun, outside Slurm and gpuswap, never held."""
    out = tmp_path_factory.mktemp("mr-reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUSWAP_"))}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(JOB), "--steps", str(STEPS), "--out", str(out)], env=_train_env({}, env),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    return out


@pytest.mark.parametrize("form", ["torchrun", "srun"])
def test_multirank_job_checkpoints_at_a_common_step_and_resumes_exactly(slurm, reference, tmp_path: Path,
                                                                        form: str) -> None:
    out, log, script = tmp_path / "out", tmp_path / "low.out", tmp_path / "train.sh"
    script.write_text(SCRIPTS[form].format(py=sys.executable, job=JOB, steps=STEPS, hold=HOLD_AT, out=out))
    opts = ["--signal=B:USR2@300"] if form == "torchrun" else ["--ntasks=2"]
    env = _train_env({"GPUSWAP_SIMULATED_GPU": "1"}, slurm.env)
    low = slurm.sbatch("-p", "low", "-t", "10", "--requeue", "--open-mode=append", "-o", str(log), *opts,
                       str(script), cwd=tmp_path, env=env)
    for rank in (0, 1):   # both ranks attached and held at the hold step
        _wait_output(log, f"train: rank {rank} holds at step {HOLD_AT}", timeout=180)
    high = slurm.sbatch("-p", "high", "-t", "1", "-o", str(tmp_path / "high.out"),
                        "--wrap", "echo high ran", cwd=tmp_path, env=env)
    slurm.wait_state(high, ("COMPLETED",), timeout=180)
    info = slurm.wait_state(low, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=240)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text, slurm.logs())
    assert int(info["Restarts"]) >= 1, (info, text)
    assert "every rank checkpoints at a common step" in text, text
    assert f"requeued Slurm job {low}" in text, text
    if form == "torchrun":
        assert "slurm-wrap got SIGUSR2" in text and "forwarding" not in text, text
    else:
        assert "got SIGTERM from Slurm" in text, text

    # one checkpoint of both ranks at one step: the manifest names a part per rank
    ckpts = sorted((tmp_path / ".gpuswap" / "ckpt" / low).glob("ckpt-*.json"))
    assert ckpts, "no checkpoint in the documented default directory"
    manifest = json.loads(ckpts[-1].read_text())
    assert manifest["format"] == "gpuswap-ckpt/2" and manifest["world_size"] == 2, manifest
    assert sorted(p["rank"] for p in manifest["parts"]) == [0, 1], manifest
    assert manifest["step"] == HOLD_AT, manifest
    for rank in (0, 1):   # every rank restored that checkpoint after the requeue
        assert f"train: rank {rank} of 2 starts at step {HOLD_AT + 1}" in text, text
        assert_bitwise(torch.load(out / f"rank{rank}.pt", weights_only=False),
                       torch.load(reference / f"rank{rank}.pt", weights_only=False), f"rank {rank}")
