"""Lightning under a (fake) Slurm job: no Slurm daemons, a real Trainer, a real signal."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fw_runner import HERE, SRC, require

require("lightning", "lightning")

from gpuswap.jobs import REQUEUE_EXIT_CODE  # noqa: E402


def test_slurm_signal_in_a_second_fit_still_checkpoints(tmp_path: Path) -> None:
    """Lightning's teardown after the first fit restores the default SIGUSR2 handler; the second
    fit's attach must take it back, so the signal becomes a checkpoint and exit 75."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join([str(HERE), SRC]))
    p = subprocess.run([sys.executable, str(HERE / "lightning_twofit_job.py")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == REQUEUE_EXIT_CODE, f"rc {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "fit 1 done" in p.stdout and "fit 2 done" not in p.stdout
    assert "SignalBridge._handler" in p.stdout       # the handler in force during fit 2 was ours
    assert "got SIGUSR2 from Slurm" in p.stderr
    manifests = sorted((tmp_path / ".gpuswap" / "ckpt" / "77").glob("ckpt-*.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["job_id"] == "77"


def _twofit(tmp_path: Path, out: str, slurm: bool, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), SRC])
    if slurm:
        env.update(SLURM_JOB_ID="78", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit")
    env.update(extra)
    return subprocess.run([sys.executable, str(HERE / "lightning_twofit_resume_job.py"), str(tmp_path / out)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_two_fits_parked_to_disk_in_the_second_resume_it_exactly(tmp_path: Path) -> None:
    """A disk park in the second of two fits (models of the same shapes): on restart the first
    fit must not take the second fit's checkpoint (it used to: Lightning restored fit 2's module,
    optimizer and loops into fit 1, and nothing refused the same shapes); it trains again from
    the start, and the second fit resumes from the checkpoint. Both end bitwise as in the run
    outside gpuswap."""
    plain = _twofit(tmp_path, "plain.json", slurm=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    parked = _twofit(tmp_path, "parked.json", slurm=True, PARK="2:5")
    assert parked.returncode == REQUEUE_EXIT_CODE, f"rc {parked.returncode}\n{parked.stderr[-3000:]}"
    assert "fit 1 done" in parked.stdout and "fit 2 done" not in parked.stdout
    manifest = json.loads(next((tmp_path / ".gpuswap" / "ckpt" / "78").glob("ckpt-*.json")).read_text())
    resumed = _twofit(tmp_path, "resumed.json", slurm=True, SLURM_RESTART_COUNT="1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == json.loads((tmp_path / "plain.json").read_text())
    assert manifest.get("attach") == 2
    assert "gpuswap: attach 1 of this process does not restore checkpoint" in resumed.stderr
    assert resumed.stderr.count("gpuswap: restored checkpoint") == 1
