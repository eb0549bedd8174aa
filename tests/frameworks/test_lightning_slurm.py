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
