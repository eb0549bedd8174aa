"""A job whose control connection reads nothing cannot stall its supervisor. Every hello that says
"parked" (a single-rank runtime parked in RAM, or rank 0 of 2 left waiting by a past attempt) is
answered with a `resume`; a job that sent thousands of them and read none filled its socket, and
the supervisor's send blocked for good while it held the lock every move takes: the job could no
longer be cancelled, paused or even observed by the daemon. Now a send that finds no room for
SEND_WAIT_S closes that connection (`channel.send_or_drop`; a runtime's reader thread always
reads: one that does not is broken) and the supervisor goes on. A real daemon and supervisor, a
hostile job on its own control socket."""
from __future__ import annotations

import json
import sys

import pytest

from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

# Says the hello in argv[3] again and again, reading nothing; then tells the test how many it sent,
# and waits for its gate.
JOB = r"""
import os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["GPUSWAP_CONTROL"])
s.settimeout(30)
hello = (sys.argv[3].replace("PID", str(os.getpid())) + "\n").encode()
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

SINGLE = {"op": "hello", "pid": "PID", "parked": True}
RANK = {"op": "hello", "pid": "PID", "rank": 0, "world_size": 2, "state": "parked", "epoch": 7}


@pytest.mark.parametrize("hello, gpus, whose", [(SINGLE, 1, "the runtime's"), (RANK, 2, "a rank's")],
                         ids=["single-rank", "rank"])
def test_a_runtime_that_reads_nothing_cannot_stall_the_supervisor(make_daemon, home, hello, gpus, whose):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, done = Gate(home / "go"), home / "sent"
    text = json.dumps(hello).replace('"PID"', "PID")
    job = d.submit([sys.executable, "-c", JOB, str(gate.path), str(done), text], name="deaf", gpus=gpus)
    d.until(job, lambda j: done.exists() and done.read_text() != "")
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    assert f"closed {whose} control connection: it reads nothing" in log, log[-3000:]
    assert int(done.read_text()) < 20000, "the supervisor read every hello: nothing was ever full"
    # The supervisor still does what the daemon asks: before, it waited on the full socket for good.
    assert d.cli("cancel", str(job)).returncode == 0
    j = d.state(job, "CANCELLED", "FAILED", "COMPLETED")
    assert j["state"] == "CANCELLED", j["events"]
    gate.open()
