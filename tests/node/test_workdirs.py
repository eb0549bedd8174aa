"""node/workdirs.py: where a waiting job's working directory can be entered, checked off the tick.

The checks here are the kernel's (launcher.cwd_problem on this machine's real directories); the Ray
test (tests/ray/test_ray_pool.py) has a node that cannot see a directory the others can."""
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from gpuswap.jobs import JobState
from gpuswap.node import workdirs
from gpuswap.node.launcher import cwd_problem
from gpuswap.node.records import JobRecord
from gpuswap.node.workdirs import RECHECK_S, RETRY_S, WorkdirChecks, reach


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _settled(checks: WorkdirChecks, nodes, cwd, uid=0, gid=0):
    """Ask until every node has an answer (the checks run on their own threads). The deadline only
    catches answers that never come."""
    deadline = time.monotonic() + 120
    while True:
        got = checks.answers(nodes, cwd, uid, gid)
        if set(got) == set(nodes) and not checks._running:
            return got
        assert time.monotonic() < deadline, f"no answers: {got}"
        threading.Event().wait(0.005)


def test_answers_are_made_off_the_caller_kept_and_asked_again_when_due(tmp_path: Path):
    calls: list[tuple] = []
    gone = tmp_path / "gone"

    def check(node, cwd, uid, gid):
        calls.append((node, cwd))
        if node == "dead":
            raise TimeoutError("agent did not answer\nsecond line")
        return cwd_problem(cwd if node == "a" else str(gone), uid, gid)

    clock = Clock()
    told = threading.Semaphore(0)
    checks = WorkdirChecks(check, clock, on_answer=told.release)
    assert checks.answers(["a", "b"], str(tmp_path), 0, 0).keys() <= {"a", "b"}   # never waits
    got = _settled(checks, ["a", "b", "dead"], str(tmp_path))
    assert got["a"] is None
    assert "does not exist" in got["b"]
    assert got["dead"] == "its working directory could not be checked on dead (agent did not answer)"
    # Each new answer wakes the controller: its check's thread does so after it stored the answer,
    # so a release may still be on its way when the answers are all in.
    assert all(told.acquire(timeout=60) for _ in range(3))
    assert not told.acquire(timeout=0)                            # and only the new ones
    n = len(calls)
    clock.now = RETRY_S + 1                    # the node that did not answer is asked again, not the others
    _settled(checks, ["a", "b", "dead"], str(tmp_path))
    assert [c[0] for c in calls[n:]] == ["dead"]
    clock.now = RECHECK_S + 1                  # every answer is due again: a mount may have come or gone
    gone.mkdir()
    got = _settled(checks, ["a", "b"], str(tmp_path))
    assert got == {"a": None, "b": None}
    checks.stop()


def test_answers_nobody_asks_for_are_forgotten():
    clock = Clock()
    checks = WorkdirChecks(lambda node, cwd, uid, gid: None, clock)
    _settled(checks, ["a"], "/")
    clock.now = workdirs.FORGET_S + RECHECK_S + 2
    _settled(checks, ["a"], "/tmp")           # asking anything prunes what was not asked for
    assert ("a", "/", 0, 0) not in checks._known and ("a", "/tmp", 0, 0) in checks._known
    checks.stop()


def _record(state: JobState, parked=None, node=None) -> JobRecord:
    """The fields of a job record that reach() reads."""
    return SimpleNamespace(id=7, cwd="/scratch/u", state=state, parked=parked, node=node)


def test_reach_names_where_a_waiting_job_may_go_and_why_not_elsewhere():
    pending = _record(JobState.PENDING)
    assert reach(pending, None, ["a", "b"]) is workdirs.ANYWHERE           # one machine: no limit
    assert reach(_record(JobState.RUNNING, node="a"), {"a": "no"}, ["a"]) is workdirs.ANYWHERE
    r = reach(pending, {"a": None, "b": "working directory '/scratch/u' does not exist"}, ["a", "b", "c"])
    assert r.nodes == ("a",) and r.wait is None
    assert r.note == "; not on b: working directory '/scratch/u' does not exist; c: not checked there yet"
    nowhere = reach(pending, {"a": "no such directory", "b": "Permission denied"}, ["a", "b"])
    assert nowhere.nodes == () and nowhere.wait is not None and nowhere.wait.code == "Workdir"
    assert not nowhere.checking
    assert nowhere.wait.text == ("its working directory /scratch/u cannot be entered as its user on any node of "
                                 "the pool now (a: no such directory; b: Permission denied)")
    # No node has said yes, and one has not answered yet: it waits for that answer (a new directory).
    checking = reach(pending, {"a": "no such directory"}, ["a", "b"])
    assert checking.nodes == () and checking.checking
    assert checking.wait.text == "its working directory /scratch/u is being checked on b"
    # A RAM-parked job keeps its node: its process is there, inside the directory already.
    in_ram = reach(_record(JobState.PAUSED, parked="ram", node="a"), {"a": "gone", "b": None}, ["a", "b"])
    assert in_ram.nodes == ("a", "b")
    on_disk = reach(_record(JobState.PAUSED, parked="disk", node="a"), {"a": "gone", "b": None}, ["a", "b"])
    assert on_disk.nodes == ("b",)
