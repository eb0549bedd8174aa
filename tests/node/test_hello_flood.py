"""A job that says hello again and again (each hello valid, each answered with an order) made its
root supervisor log one line and fsync status.json once per hello: thousands a second, on the
disk every other job shares. What a job's messages cause is now paced (node/statusfile.py
`Bucket`): a burst, then one per interval; nothing is lost, only held back. A real daemon and
supervisor and a job on its own control socket that reads every answer."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from gpuswap.node import statusfile
from gpuswap.node.statusfile import JOB_LINES_BURST, PACED_LINE_S, USAGE_WRITE_S, StatusFile
from gpuswap.protocol.status import SupervisorStatus
from gpuswap_testing import Gate

HELLOS = 3000

# Says hello as a runtime still parked in RAM and reads the `resume` each one gets, HELLOS times;
# writes how long that took; waits for its gate.
JOB = r"""
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["GPUSWAP_CONTROL"])
s.settimeout(60)
f = s.makefile("rb")
hello = (json.dumps({"op": "hello", "pid": os.getpid(), "parked": True}) + "\n").encode()
t0 = time.monotonic()
for _ in range(int(sys.argv[3])):
    s.sendall(hello)
    assert json.loads(f.readline())["op"] == "resume"
open(sys.argv[2], "w").write(str(time.monotonic() - t0))
deadline = time.monotonic() + 600
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_job_saying_hello_in_a_loop_gets_a_paced_log(make_daemon, home):
    d = make_daemon()
    gate, done = Gate(home / "go"), home / "took"
    job = d.submit([sys.executable, "-c", JOB, str(gate.path), str(done), str(HELLOS)], name="chatty")
    d.until(job, lambda j: done.exists() and done.read_text() != "")
    took = float(done.read_text())
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    sent = [line for line in log.splitlines() if " sent {" in line]
    # every hello was answered (the job read HELLOS resumes); the log holds a burst and then one a second
    assert len(sent) <= JOB_LINES_BURST + took / PACED_LINE_S + 2, (len(sent), took)
    assert "such lines before this one not logged" in log or len(sent) == HELLOS, log[-2000:]
    assert d.cli("cancel", str(job)).returncode == 0
    assert d.state(job, "CANCELLED", "FAILED", "COMPLETED")["state"] == "CANCELLED"
    gate.open()


def test_status_writes_a_job_asks_for_are_paced_and_none_is_lost(tmp_path, monkeypatch):
    """Past the burst, a job's writes are held back; the main loop's next due write saves the
    last change."""
    monkeypatch.setattr(statusfile, "JOB_WRITES_BURST", 10)
    files = StatusFile(tmp_path, SupervisorStatus(job_id=1, generation=1, supervisor_pid=os.getpid(),
                                                  started_at=time.time()), threading.RLock())
    t0 = time.monotonic()
    for step in range(1000):
        files.status.runtime["step"] = step
        files.write_for_job()
    took = time.monotonic() - t0
    assert 10 <= files.writes <= 10 + took / USAGE_WRITE_S + 1, (files.writes, took)   # the burst, and the refill
    while not files.due():             # USAGE_WRITE_S after the last write
        time.sleep(0.05)
    assert files.write()
    assert json.loads((tmp_path / "status.json").read_text())["runtime"]["step"] == 999
