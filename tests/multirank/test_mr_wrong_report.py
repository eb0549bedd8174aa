"""A rank's report that does not fit the move under way is ignored, never trusted: a RAM park
answered with a checkpoint part (or a disk park with `paused`) is not that rank's answer. Before,
a part among the `paused` reports of a RAM park was read as one (an AttributeError in a thread of
the root supervisor, which then stopped reading that connection), and the job ended "no rank did
not finish parking" without naming the rank. A real daemon; the job is two fake ranks in one
process that speak the protocol and lie at the park."""
from __future__ import annotations

import sys

import pytest

from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

JOB = r"""
import json, os, socket, sys, threading, time

def rank(r):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ["GPUSWAP_CONTROL"])
    send = lambda **m: s.sendall((json.dumps(m) + "\n").encode())
    send(op="hello", pid=os.getpid(), rank=r, world_size=2, local_rank=r, state="running")
    for line in s.makefile("rb"):
        m = json.loads(line)
        op, e = m["op"], m.get("epoch")
        if op == "pause":
            send(op="mark", epoch=e, seen=0)
        elif op == "target":
            send(op="ready", epoch=e, tick=m["tick"], step=0)
        elif op == "park" and r == 0:
            send(op="paused", epoch=e, tier="ram", bytes=10, seconds=0.0, step=0)
        elif op == "park":       # a RAM park answered with a part of a checkpoint
            send(op="part", epoch=e, file="ckpt-000001.r1.pt", bytes=1, sha256="0" * 64, seconds=0.0)

for r in (0, 1):
    threading.Thread(target=rank, args=(r,), daemon=True).start()
deadline = time.monotonic() + 600
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_a_part_answering_a_ram_park_is_not_taken_for_the_rank_parked(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", "5")
    gate = Gate(home / "go")
    job = d.submit([sys.executable, "-c", JOB, str(gate.path)], name="liar", gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    j = d.state(job, "FAILED", "COMPLETED", "CANCELLED", "PAUSED")
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    gate.open()
    assert j["state"] == "FAILED", (j["events"], log[-2000:])
    reason = j["events"][-1]["reason"]
    assert "rank 1" in reason and "did not finish parking" in reason, (reason, log[-2000:])
    assert "rank 0" not in reason.split("(main process")[0], reason      # rank 0 did park
