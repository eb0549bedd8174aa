"""Finding and killing every process of a job's session, immune to PID reuse.

A job is started in its own session (`start_new_session`), so its session id is its first pid and
every process it forks stays in that session unless it calls setsid(2) itself. When the job's
supervisor is gone, nobody else will ever reap or signal them: they must be killed before the job's
GPUs are given to another job.

PID reuse: a process is signalled through a pidfd opened *before* its session is checked, so the
signal reaches exactly the process that was checked (a pid reused in between gets nothing). A
session whose leader pid is alive with another start time than the job's is a different session
that reused the number: nothing of it is touched.
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Iterable, Optional


def _stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, session id, start time in clock ticks since boot) of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()   # the command name may hold spaces and ')'
    return fields[0].decode(), int(fields[3]), int(fields[19])


def start_ticks(pid: int) -> Optional[int]:
    """When a process started (clock ticks since boot): with its pid, names it uniquely."""
    st = _stat(pid)
    return st[2] if st else None


def members(sid: int, started: Optional[int] = None) -> list[int]:
    """Live (non-zombie) processes of session `sid`. With `started` (the leader's start ticks), a
    leader that is alive but started at another time means the number was reused: none."""
    if started is not None:
        leader = _stat(sid)
        if leader is not None and leader[2] != started:
            return []
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None and st[1] == sid and st[0] not in ("Z", "X") \
                and (started is None or st[2] >= started):
            out.append(int(name))
    return out


def kill(sid: int, started: Optional[int] = None) -> int:
    """SIGKILL every process of session `sid`; returns how many were still there (0: none left)."""
    return _kill_each(members(sid, started), lambda pid, st: st[1] == sid)


def kill_pids(records: list[tuple[int, Optional[int]]]) -> int:
    """SIGKILL each (pid, start ticks) process that is still that process: the ranks of a multi-rank
    job, which torchrun starts as session leaders of their own, outside the job's session.
    Returns how many were still alive (0: none left). A pid that now names a process started at
    another time, or a zombie, is left alone."""
    started = dict(records)
    return _kill_each(started, lambda pid, st: started[pid] is None or st[2] == started[pid])


def _kill_each(pids: Iterable[int], still_ours: Callable[[int, tuple[str, int, int]], bool]) -> int:
    """SIGKILL each pid that is still the process meant: pinned by a pidfd first, then checked
    (not a zombie, `still_ours(pid, stat)`), so a recycled pid is never hit."""
    left = 0
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue                      # gone already
        try:
            st = _stat(pid)               # checked after the pidfd pins the process
            if st is None or st[0] in ("Z", "X") or not still_ours(pid, st):
                continue
            left += 1
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return left

def alive(sid: int, started: Optional[int], ranks: Iterable[tuple[int, Optional[int]]] = ()) -> int:
    """How many processes `kill(sid, started)` and `kill_pids(ranks)` would signal now (none signalled)."""
    left = len(members(sid, started))
    for pid, ticks in ranks:
        st = _stat(pid)
        if st is not None and st[0] not in ("Z", "X") and (ticks is None or st[2] == ticks):
            left += 1
    return left
