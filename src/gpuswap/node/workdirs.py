"""Where a waiting job's working directory can be entered, node by node, in a pool (docs/ray.md).

A job starts, and restarts from a disk checkpoint, by entering its working directory as its user;
on a node where it cannot, that start would fail the job. So in a pool the policy is told, for each
waiting job, the nodes where it may start or resume (JobView.allowed_nodes): those whose kernel let
its user enter the directory (launcher.cwd_problem, asked through each node's agent). A RAM-parked
job keeps its own node whatever the answer: its process is there and already inside the directory.

A check is slow and remote (a process run as the user; a hung mount waits out its timeout), so it
is never made on the controller's tick: `WorkdirChecks` makes them on its own threads and keeps each
answer RECHECK_S (a mount that appears or goes is seen within that), and a tick reads only what is
known. A node not checked yet is not a candidate yet: the first answer comes within the agent's
call time, after which the job is placed where it can run, never where it would fail.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from gpuswap.jobs import JobState
from gpuswap.node.records import JobRecord
from gpuswap.policy.model import Wait

log = logging.getLogger("gpuswap.workdirs")

RECHECK_S = 60.0          # an answer is asked again after this long (kept meanwhile)
RETRY_S = 10.0            # a check that could not be made (the node did not answer) is tried again sooner
FORGET_S = 600.0          # an answer nobody asked for this long is dropped
MAX_KNOWN = 20_000        # answers kept at most (distinct node, directory and user)
WORKERS = 4               # checks in flight at once (a node's agent serves 4 such calls at once)
NOT_CHECKED = "not checked there yet"
CODE = "Workdir"

Key = tuple[str, str, int, int]           # node, working directory, uid, gid
Check = Callable[[str, str, int, int], Optional[str]]


class WorkdirChecks:
    """Answers of `check(node, cwd, uid, gid)` (None: the user can enter it there; else why not),
    made in the background and kept; `answers` never waits for one."""

    def __init__(self, check: Check, clock: Callable[[], float] = time.monotonic, workers: int = WORKERS,
                 on_answer: Callable[[], None] = lambda: None):
        self._check, self._clock, self._on_answer = check, clock, on_answer
        self._lock = threading.Lock()
        self._known: dict[Key, tuple[Optional[str], float]] = {}    # key -> (answer, when to ask again)
        self._asked: dict[Key, float] = {}                           # key -> when last read
        self._running: set[Key] = set()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="workdir")
        self._pruned = clock()

    def answers(self, nodes: Iterable[str], cwd: str, uid: int, gid: int) -> dict[str, Optional[str]]:
        """What is known for each of `nodes` (absent: not checked yet); asks again where due."""
        now = self._clock()
        out: dict[str, Optional[str]] = {}
        due: list[Key] = []
        with self._lock:
            for node in nodes:
                key = (node, cwd, uid, gid)
                self._asked[key] = now
                found = self._known.get(key)
                if found is not None:
                    out[node] = found[0]
                if (found is None or now >= found[1]) and key not in self._running:
                    self._running.add(key)
                    due.append(key)
            if now - self._pruned > RECHECK_S or len(self._asked) > MAX_KNOWN:
                self._prune(now)
        for key in due:
            try:
                self._executor.submit(self._run, key)
            except RuntimeError:       # shut down: the daemon is stopping
                with self._lock:
                    self._running.discard(key)
        return out

    def _run(self, key: Key) -> None:
        node = key[0]
        try:
            answer, again = self._check(*key), RECHECK_S
        except Exception as e:          # the node did not answer: not a reason to place it there
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            answer, again = f"its working directory could not be checked on {node} ({first})", RETRY_S
        with self._lock:
            changed = self._known.get(key, (NOT_CHECKED,))[0] != answer
            self._known[key] = (answer, self._clock() + again)
            self._running.discard(key)
        if changed:
            self._on_answer()       # the controller's next tick places the job without waiting for its timer

    def _prune(self, now: float) -> None:
        """Drop answers nobody asked for in FORGET_S, and the oldest asked past MAX_KNOWN."""
        self._pruned = now
        stale = [k for k, at in self._asked.items() if now - at > FORGET_S]
        if len(self._asked) - len(stale) > MAX_KNOWN:
            stale += sorted((k for k in self._asked if now - self._asked[k] <= FORGET_S),
                            key=self._asked.__getitem__)[:len(self._asked) - len(stale) - MAX_KNOWN]
        for k in stale:
            self._asked.pop(k, None)
            self._known.pop(k, None)

    def stop(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class Reach:
    """Where a waiting job may start or resume, by its working directory: `nodes` (empty: no limit,
    one machine), and `wait` when that is nowhere now (it stays out of the round), or `note` naming
    the nodes left out and why (added to the round's own reason). `checking`: nowhere only because
    no node has answered yet (a new directory: within a tick or two; not worth an event)."""
    nodes: tuple[str, ...] = ()
    wait: Optional[Wait] = None
    note: str = ""
    checking: bool = False


ANYWHERE = Reach()


def reach(job: JobRecord, answers: Optional[Mapping[str, Optional[str]]], pool_nodes: Iterable[str]) -> Reach:
    """`answers`: the pool's (WorkdirChecks.answers) for the job's directory and user, or None on
    one machine. Only waiting jobs are limited: a running one is where it is."""
    if answers is None or job.state not in (JobState.PENDING, JobState.PAUSED):
        return ANYWHERE
    ok = {n for n, problem in answers.items() if problem is None}
    if job.state == JobState.PAUSED and job.parked == "ram" and job.node:
        ok.add(job.node)            # its process is there, inside the directory already
    left_out = {n: answers.get(n, NOT_CHECKED) for n in sorted(pool_nodes) if n not in ok}
    why = "; ".join(f"{n}: {p}" for n, p in left_out.items())
    unchecked = [n for n, p in left_out.items() if p == NOT_CHECKED]
    if not ok and unchecked:
        return Reach((), Wait(str(job.id), CODE, f"its working directory {job.cwd} is being checked on "
                                                  f"{', '.join(unchecked)}"), checking=True)
    if not ok:
        return Reach((), Wait(str(job.id), CODE, f"its working directory {job.cwd} cannot be entered as its "
                                                  f"user on any node of the pool now ({why})"))
    return Reach(tuple(sorted(ok)), None, f"; not on {why}" if left_out else "")
