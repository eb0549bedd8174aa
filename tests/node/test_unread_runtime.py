"""A single-rank job whose runtime connection reads nothing cannot stall its supervisor. Every
hello that says "parked" is answered with a `resume`; a job that sent thousands of them and read
none filled its socket, and the supervisor's send blocked for good while it held the lock every
move takes: the job could no longer be cancelled. Now a send that finds no room for SEND_WAIT_S
closes that connection, as for a rank (tests/multirank/test_mr_unread.py). A real daemon and
supervisor, a hostile job on its own control socket."""
from __future__ import annotations

import sys

import pytest

from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

# Says hello as a single-rank runtime still parked in RAM, again and again, reading nothing (the
# daemon wants it running: each hello is answered with a resume); then tells the test and waits
# for its gate.
JOB = r"""
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["GPUSWAP_CONTROL"])
s.settimeout(30)
hello = (json.dumps({"op": "hello", "pid": os.getpid(), "parked": True}) + "\n").encode()
sent = 0
try:
    for _ in range(20000):
        s.sendall(hello)
        sent += 1
except OSError as e:
    print("stopped sending:", e, flush=True)
print("sent", sent, flush=True)
open(sys.argv[2], "w").write(str(sent))
deadline = time.monotonic() + 600
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_a_runtime_that_reads_nothing_cannot_stall_the_supervisor(make_daemon, home):
    d = make_daemon()
    gate, done = Gate(home / "go"), home / "sent"
    job = d.submit([sys.executable, "-c", JOB, str(gate.path), str(done)], name="deaf")
    d.until(job, lambda j: done.exists() and done.read_text() != "")
    # The supervisor still does what the daemon asks: before, it waited on the full socket for good.
    assert d.cli("cancel", str(job)).returncode == 0
    j = d.state(job, "CANCELLED", "FAILED", "COMPLETED")
    assert j["state"] == "CANCELLED", j["events"]
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    assert "closed the runtime's control connection: it reads nothing" in log, log[-3000:]
    assert int(done.read_text()) < 20000, "the supervisor read every hello: nothing was ever full"
    gate.open()
