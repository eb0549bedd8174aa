"""Finding and killing every process of a job's session, immune to PID reuse.

A job is started in its own session (`start_new_session`), so its session id is its first pid and
every process it forks stays in that session unless it calls setsid(2) itself. When the job's
supervisor is gone, nobody else will ever reap or signal them: they must be killed before the job's
GPUs are given to another job.

PID reuse: a process is signalled through a pidfd opened *before* its session is checked, so the
signal reaches exactly the process that was checked (a pid reused in between gets nothing). A
session whose leader pid is alive with another start time than the job's is a different session
that reused the number: nothing of it is touched.

Another user's session that reused the number after its leader exited (the usual way a daemon
detaches: setsid, fork, the leader exits) has no leader to tell it apart, and its processes
started after the job's: only the job's uid does. No process that uid could not signal itself
is counted or killed (`processes.owned_by`), so root never kills another user's process for a job,
and a job is never kept from ending by processes that are not its own.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from gpuswap.processes import kill_each, owned_by, stat


def job_uid(uid: int) -> int:
    """The uid a job submitted as `uid` runs as under this process: that uid only when we are
    root (node/jobprocess.py), else ours."""
    return uid if os.geteuid() == 0 else os.geteuid()


def members(sid: int, started: Optional[int], uid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid` that `uid` (the job's) owns. With `started`
    (the leader's start ticks), a leader that is alive but started at another time means the
    number was reused: none."""
    if started is not None:
        leader = stat(sid)
        if leader is not None and leader[2] != started:
            return []
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = stat(int(name))
        if st is not None and st[1] == sid and st[0] not in ("Z", "X") \
                and (started is None or st[2] >= started) and owned_by(int(name), uid):
            out.append(int(name))
    return out


def kill(sid: int, started: Optional[int], uid: int) -> int:
    """SIGKILL every process of session `sid` that `uid` owns; returns how many were still there
    (0: none left)."""
    return kill_each(members(sid, started, uid), lambda pid, st: st[1] == sid, uid)


def alive(sid: int, started: Optional[int], uid: int, ranks: Iterable[tuple[int, Optional[int]]] = ()) -> int:
    """How many processes `kill(sid, started, uid)` and `processes.kill_pids(ranks, uid)` would
    signal now (none signalled)."""
    left = len(members(sid, started, uid))
    for pid, ticks in ranks:
        st = stat(pid)
        if st is not None and st[0] not in ("Z", "X") and ticks is not None and st[2] == ticks \
                and owned_by(pid, uid):
            left += 1
    return left
