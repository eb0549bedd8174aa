"""A job's control socket cannot be turned against the machine (the root supervisor behind it).

* Connections: each is served by a thread of the supervisor, a root process. A job that opened
  thousands could use up the machine's pids; those beyond what the job can use are closed at once.
* Rank processes: the supervisor and the daemon SIGKILL a multi-rank job's rank processes when it
  ends, by (pid, start time). A process named by its pid alone may be anyone's by then, so such a
  record is never killed, and none is made: the start time is read when the connection is accepted.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpuswap import processes
from gpuswap.node import sessions
from gpuswap.node.jobchannel import SPARE_CONNS
from gpuswap.protocol import records
from gpuswap.runtime.ranktable import MAX_PROCESSES, RankTable

HERE = Path(__file__).parent
FLOOD = 300


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


def test_a_job_flooding_its_control_socket_gets_a_bounded_number_served_and_no_rank_pid_without_its_start_time(
        make_daemon, home):
    daemon = make_daemon()
    out = home / "flood"
    out.mkdir()
    out.chmod(0o777)
    job = daemon.submit([sys.executable, str(HERE / "conn_flood_job.py"), str(out), str(FLOOD)])
    daemon.state(job, "RUNNING")
    run = home / "jobs" / str(job) / "run-1"
    daemon.until(job, lambda _: (out / "held.json").exists())
    held = json.loads((out / "held.json").read_text())
    served = SPARE_CONNS + 1                       # one GPU: one rank at most, and the spare ones
    assert held == {"opened": FLOOD, "closed": FLOOD - served}, held
    supervisor = json.loads((run / "spawned.json").read_text())["pid"]
    assert threads(supervisor) <= served + 8, threads(supervisor)     # not one per connection opened
    assert "more than this job can use" in (run / "supervisor.log").read_text()

    (out / "go").touch()
    daemon.until(job, lambda _: (out / "dance.json").exists())
    gone = json.loads((out / "dance.json").read_text())["gone"]
    status = json.loads((run / "status.json").read_text())
    recorded = status.get("rank_pids") or []
    # Every rank process is recorded with its start time (read at accept, while it was there), or
    # not at all; none of the gone connectors is left named by a bare pid.
    assert all(r["start_ticks"] is not None for r in recorded), recorded
    assert {r["pid"] for r in recorded} <= set(gone), (recorded, gone)
    assert processes.kill_pids([(r["pid"], r["start_ticks"]) for r in recorded]) == 0
    r = daemon.cli("cancel", str(job))
    assert r.returncode == 0, r.stderr
    daemon.state(job, "CANCELLED")


@pytest.fixture
def bystander():
    """A process that is not the job's: what a reused pid would name."""
    p = subprocess.Popen(["sleep", "600"])
    yield p
    p.kill()
    p.wait()


def test_a_pid_without_its_start_time_or_with_another_is_never_killed(bystander):
    ticks = processes.start_ticks(bystander.pid)
    assert ticks is not None
    assert processes.kill_pids([(bystander.pid, None)]) == 0
    assert processes.kill_pids([(bystander.pid, ticks + 1)]) == 0
    assert sessions.alive(10**7, None, os.geteuid(), [(bystander.pid, None), (bystander.pid, ticks + 1)]) == 0
    assert bystander.poll() is None                                 # untouched
    assert sessions.alive(10**7, None, os.geteuid(), [(bystander.pid, ticks)]) == 1
    assert processes.kill_pids([(bystander.pid, ticks)]) == 1       # the process meant: killed
    assert bystander.wait(60) == -9


def test_the_rank_table_records_only_processes_with_a_start_time_and_a_bounded_number():
    table = RankTable(60.0, on_kill=lambda reason: None, log=lambda line: None)
    pairs = []
    hello = records.Hello(rank=0, world_size=2)

    def say(pid, ticks):
        a, b = socket.socketpair()
        pairs.append((a, b))
        ok = table.hello(a, hello, pid, 0.0, ticks)
        table.lost(a, 0.0)                          # rank 0 gone again: the next may take it
        return ok

    assert say(100, None)
    assert table.pid_records() == []                # no start time: not a process it may kill
    for pid in range(1000, 1000 + MAX_PROCESSES):
        assert say(pid, 7)
    assert len(table.pid_records()) == MAX_PROCESSES
    assert not say(10**6, 7)                        # a new process past the bound is refused
    assert say(1000, 7)                             # one already known is not a new entry
    for a, b in pairs:
        a.close()
        b.close()
