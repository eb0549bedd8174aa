"""`gpuswap wait` outlives a daemon restart: the job's state is kept, and asking for it is safe to
repeat, so a script waiting on a job gets the job's own exit code, not 69 (the daemon was away)."""
from __future__ import annotations

import subprocess
import sys

from gpuswap_testing import Gate


def test_wait_returns_the_jobs_code_across_a_daemon_killed_and_started_again(make_daemon, home):
    daemon = make_daemon()
    gate = Gate(home / "w.go")
    argv = gate.sh()
    job = daemon.submit(argv[:2] + [argv[2] + "; exit 7"] + argv[3:])
    daemon.state(job, "RUNNING")
    waiting = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "wait", str(job)], env=daemon.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    daemon.kill9()                  # mid-wait, or before its first request: either way it finds no daemon
    daemon.start()
    gate.open()
    out, err = waiting.communicate(timeout=300)
    assert waiting.returncode == 7, (waiting.returncode, err)
    assert daemon.job(job)["exit_code"] == 7
