"""No process of a multi-rank job outlives it, whether or not it ever attached: torchrun starts
each worker as a session leader of its own, outside the job's session, and a worker that never
said hello (a job without the runtime, a rank still starting) was known to nobody. When the
launcher died before its workers (killed after the cancel grace while a worker took its time over
SIGTERM, or by the OOM killer), they ran on, on GPUs the daemon gave to the next job. The
supervisor is now the subreaper of everything the job starts: orphans come to it, and it kills
them before it records the end. A real daemon, real torchrun, real signals."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mr_testing import alive
from gpuswap_testing import FACT_TIMEOUT_S

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

# A torchrun worker that ignores SIGTERM (as one that saves a checkpoint on it would, for longer
# than the cancel grace), writes its pid and waits: no gpuswap runtime, no process group.
WORKER = """import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: None)
with open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    time.sleep(0.1)
"""


def _pids(out: Path, n: int) -> list[int]:
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while True:
        try:
            return [int((out / f"pid{r}").read_text()) for r in range(n)]
        except (OSError, ValueError):
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)


def _torchrun(script: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(script), str(out)]


def _setup(home: Path) -> tuple[Path, Path]:
    script, out = home / "worker.py", home / "out"
    script.write_text(WORKER)
    out.mkdir()
    return script, out


def test_workers_of_a_cancelled_torchrun_job_do_not_outlive_it(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    script, out = _setup(home)
    job = d.submit(_torchrun(script, out), name="stubborn", gpus=2)
    pids = _pids(out, 2)
    assert all(os.getsid(p) == p for p in pids)          # torchrun's workers lead their own sessions
    assert d.cli("cancel", str(job)).returncode == 0
    j = d.state(job, "CANCELLED", "FAILED", "COMPLETED")
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers left running after the job ended {j['state']}: {left}"


def test_workers_of_a_torchrun_job_whose_launcher_is_killed_do_not_outlive_it(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    script, out = _setup(home)
    job = d.submit(_torchrun(script, out), name="oom", gpus=2)
    pids = _pids(out, 2)
    launcher = int(open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[1])
    os.kill(launcher, signal.SIGKILL)                      # as the OOM killer would
    j = d.state(job, "CANCELLED", "FAILED", "COMPLETED")
    assert j["state"] == "FAILED", j["events"]
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers left running after the job ended: {left}"
