"""Root kills for a job only what the job's user could kill (node/sessions.py, processes.py).

A job's session id is its first pid. Once that process is reaped the number may be reused, and
another user's program that detaches the usual way (setsid, fork, the leader exits) leaves a
session of that number with no leader, whose processes all started after the job's: neither the
leader check nor the start time tells them apart, only their owner does. Here such a session is
made for real, as another user, and the job's recorded (session, start time) names it."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from gpuswap import processes
from gpuswap.node import sessions
from gpuswap_testing import ensure_user


@pytest.fixture
def others_detached():
    """(session id, pid) of another user's process left alone in a session whose leader exited."""
    uid, gid = ensure_user("gsother")
    leader = subprocess.Popen(["sh", "-c", "sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], user=uid, group=gid,
                              extra_groups=[], cwd="/", start_new_session=True, stdout=subprocess.PIPE, text=True)
    out, _ = leader.communicate()
    leader.wait()                                   # the leader is gone: its number names no process
    pid = int(out)
    yield leader.pid, pid, uid
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _gone(pid: int) -> bool:
    st = processes.stat(pid)
    return st is None or st[0] in ("Z", "X")


def test_a_session_reused_by_another_user_is_neither_killed_nor_counted(others_detached):
    sid, pid, other = others_detached
    assert processes.stat(pid)[1] == sid and processes.stat(sid) is None
    started = processes.start_ticks(pid)          # the job's leader started no later than these
    job = 0 if other != 0 else 1                    # the job's user: root's, here, not theirs
    assert sessions.alive(sid, started, job, [(pid, started)]) == 0    # nothing left of the job
    assert sessions.kill(sid, started, job) == 0
    assert processes.kill_pids([(pid, started)], job) == 0
    assert not _gone(pid)                                              # untouched
    # Its own user's job would have it killed: the check is the owner, nothing else.
    assert sessions.alive(sid, started, other) == 1
    assert sessions.kill(sid, started, other) == 1
    deadline = time.monotonic() + 300
    while not _gone(pid):
        assert time.monotonic() < deadline, "the process the job's user owns was not killed"
        time.sleep(0.05)


def test_a_process_of_the_job_that_runs_a_setuid_program_is_still_the_jobs():
    # Its real uid stays the user's, as kill(2) sees it: a job's `sudo` or `ping` ends with the job.
    me = os.getuid()
    assert processes.owned_by(os.getpid(), me)
    assert not processes.owned_by(os.getpid(), me + 1)
    assert not processes.owned_by(2**22 + 1, me)     # no such process: not the job's
