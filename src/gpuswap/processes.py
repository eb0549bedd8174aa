"""A process named by its pid and its start time, and killed only if it is still that process.

A pid alone can be reused; with the start time (clock ticks since boot, /proc/PID/stat) it names
one process for good. A kill goes through a pidfd opened *before* the process is checked, so the
signal reaches exactly the process that was checked. Given the job's uid, a kill also spares any
process that uid could not signal itself (`owned_by`): root kills for a job only what its user
could kill. Shared by the daemon (node/sessions.py, a
job's session), the supervisor and the in-job Slurm coordinator (runtime/ranktable.py: a
multi-rank job's ranks, which torchrun starts outside the job's session).
"""
from __future__ import annotations

import os
import signal
from typing import Callable, Iterable, Optional


def stat(pid: int) -> Optional[tuple[str, int, int]]:
    """(state, session id, start time in clock ticks since boot) of a process, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split()   # the command name may hold spaces and ')'
    return fields[0].decode(), int(fields[3]), int(fields[19])


def parent(pid: int) -> Optional[int]:
    """The parent pid of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return int(data[data.rindex(b")") + 2:].split()[1])


def start_ticks(pid: int) -> Optional[int]:
    """When a process started (clock ticks since boot): with its pid, names it uniquely."""
    st = stat(pid)
    return st[2] if st else None


def owned_by(pid: int, uid: int) -> bool:
    """Whether `uid` could signal the process itself (kill(2) for an unprivileged sender: the
    target's real or saved uid is the sender's): a job's processes are, and so is one of them that
    runs a setuid program; another user's process, or one that became root for good, is not.
    False if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
        real, _effective, saved = data.split(b"\nUid:", 1)[1].split()[:3]
        return uid in (int(real), int(saved))
    except (OSError, IndexError, ValueError):
        return False


def kill_pids(records: list[tuple[int, Optional[int]]], uid: Optional[int] = None) -> int:
    """SIGKILL each (pid, start ticks) process that is still that process: the ranks of a multi-rank
    job, which torchrun starts as session leaders of their own, outside the job's session.
    Returns how many were still alive (0: none left). A pid that now names a process started at
    another time, or a zombie, is left alone, and so is one whose start time was never known: a
    bare pid may name anyone's process by now (a rank's connecting process that was already gone
    when it was looked at left only its pid, which a job could then get reused under root's kill).
    With `uid` (the job's), one that `uid` does not own is left alone too."""
    started = dict(records)
    return kill_each(started, lambda pid, st: started[pid] is not None and st[2] == started[pid], uid)


def kill_each(pids: Iterable[int], still_ours: Callable[[int, tuple[str, int, int]], bool],
              uid: Optional[int] = None) -> int:
    """SIGKILL each pid that is still the process meant: pinned by a pidfd first, then checked
    (not a zombie, `still_ours(pid, stat)`, and owned by `uid` if given), so a recycled pid is
    never hit, nor another user's process."""
    left = 0
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue                      # gone already
        try:
            st = stat(pid)                # checked after the pidfd pins the process
            if st is None or st[0] in ("Z", "X") or not still_ours(pid, st) \
                    or (uid is not None and not owned_by(pid, uid)):
                continue
            left += 1
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return left
