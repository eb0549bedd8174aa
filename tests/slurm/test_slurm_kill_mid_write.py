"""Slurm's SIGKILL at the end of GraceTime landing while the checkpoint is being written: the
previous good checkpoint survives and the next restart resumes from it (fake Slurm
environment, real processes and signals)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gpuswap import fsutil
from gpuswap.jobs import REQUEUE_EXIT_CODE

SRC = str(Path(__file__).resolve().parents[2] / "src")
JOB = textwrap.dedent("""
    import sys, time, torch, gpuswap
    big = torch.zeros(24 << 20)                      # 96 MiB: the write takes a while
    job = gpuswap.attach(big=big)
    print(f"start {job.start_step}", flush=True)
    for step in range(job.start_step, 10**6):
        big[0] = step
        time.sleep(0.005)
        job.safepoint(step)
""")


def _start(tmp: Path, restarts: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="9", SLURM_SUBMIT_DIR=str(tmp), SLURM_RESTART_COUNT=str(restarts),
               GPUSWAP_SLURM_REQUEUE="exit", PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, "-c", JOB], env=env, cwd=tmp, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _started(p: subprocess.Popen) -> int:
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("start "), line + (p.stderr.read() if p.stderr else "")
    return int(line.split()[1])


def test_sigkill_mid_write_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / ".gpuswap" / "ckpt" / "9"
    p = _start(tmp_path, 0)
    assert _started(p) == 0
    time.sleep(0.3)
    p.send_signal(signal.SIGUSR2)
    assert p.wait(timeout=180) == REQUEUE_EXIT_CODE
    first = sorted(ckpt.glob("ckpt-*.json"))
    assert len(first) == 1

    p = _start(tmp_path, 1)
    resumed = _started(p)
    assert resumed > 0
    time.sleep(0.3)
    p.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # SIGKILL once the payload is partly on disk
        temps = [f for f in ckpt.iterdir() if fsutil.is_temp(f.name)]
        if temps and temps[0].stat().st_size > (1 << 20):
            break
        time.sleep(0.001)
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert sorted(ckpt.glob("ckpt-*.json")) == first, "a half-written checkpoint was committed"

    p = _start(tmp_path, 2)
    assert _started(p) == resumed  # the last good checkpoint, again
    p.kill()
    p.wait()
