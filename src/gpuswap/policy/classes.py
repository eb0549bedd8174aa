"""Classes with limits (issue 15, item 5): a class keeps its head start but cannot starve the others.

Strict classes let a class that never ends -- long-running services marked `urgent` -- hold every
GPU it wants for as long as it wants: on a production trace whose services carried ~80% of the GPU
demand, batch jobs waited ~1.76 M s on average. Two limits, both computed here from the snapshot
alone (no memory in the policy: what must be remembered, each user's decayed GPU-time per class,
is kept by whoever builds the snapshot, as fair-share usage is):

* **A per-user budget for the classes above normal.** `Snapshot.class_usage[(user, class)]` is
  the user's decayed GPU-seconds of service in jobs of that class (`urgent` or `high`; half-life
  `class_half_life_s`). Past `class_budget_gpu_h`, the user's jobs of that class are treated one
  class down -- in the order, as preemptors and as victims -- with reasons that say so. A user
  under budget keeps the full head start. Usage counts the declared class, demoted or not, so a
  user over budget stays over while their jobs keep running and falls back under only as it decays
  (no flapping at the threshold).
* **A floor share for every class below the highest present.** `class_floor_share` of the healthy
  GPUs (rounded down: 2 GPUs of an 8-GPU server at the default 0.25, none of a 3-GPU one) is each lower
  class's guarantee against the classes above it. Its most deserving jobs (in the policy's own
  order within a class) count in while the class's jobs before them hold less than the floor --
  a wide job too, so the floor may be passed by one job's width: a share that only narrow jobs
  could use would leave a wide job starving behind long services that never free a whole node.
  Holders that count in are *protected*: paused only for a job of their own class (the
  within-class rules still apply, so a short job still overtakes a long one). Waiting jobs that
  count in (the class holds less than its floor) are *lifted*: served before the other classes
  and allowed to pause their jobs outside the floors, victims of the lowest class first as always.
* **The head start is kept within budget.** A job of a budgeted class whose user is under budget
  (a *head-start* job) is outside the floors: it may pause a protected job, a lifted job may not
  pause it, and it is served before lifted jobs. An urgent job of a user within budget therefore
  starts as fast as under strict classes, whatever its width and the server's size; what bounds
  its class is the budget, which bounds each user's urgent GPU-time. With the budget off
  (infinite) nobody has a head start and the floors hold against every class.

Both are off when `class_budget_gpu_h` is infinite and `class_floor_share` is 0: gpuswap's strict
classes, as before. Only the `gpuswap` policy applies them; `priority` stays the strict baseline.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from heapq import heapify, heappop
from typing import Callable, Mapping, Optional, Sequence

from gpuswap.jobs import Priority
from gpuswap.policy.model import JobView, Phase, Snapshot

# The classes the order and the preemption levels compare, above the plain ones (0..3, one down
# over a budget): head-start jobs at HEAD + their class, lifted jobs at FLOOR just below them.
FLOOR = 10
HEAD = FLOOR + 1
BUDGETED = (int(Priority.URGENT), int(Priority.HIGH))   # classes whose GPU-time a user is budgeted

_HEALTHY: list = [None, 0]   # memo: the last GPU tuple seen and its healthy GPUs
_HOLDING = frozenset({Phase.RUNNING, Phase.RESUMING})
_WAITING = frozenset({Phase.PENDING, Phase.PAUSED})


@dataclass(frozen=True, slots=True)
class Limits:
    """What the limits make of one snapshot (empty: strict classes)."""

    base: Mapping[str, int] = field(default_factory=dict)   # job id -> class, where a budget demoted it
    lifted: frozenset[str] = frozenset()     # waiting jobs served at FLOOR: their class is under its floor
    protected: frozenset[str] = frozenset()  # GPU holders within their class's floor
    floor_gpus: int = 0                      # each lower class's floor, in GPUs
    head: frozenset[str] = frozenset()       # jobs of a budgeted class whose user is under budget
    # The jobs `level_class` may place elsewhere than their own class (lifted, demoted, head
    # start): every other job is compared at its own. Few; the batch rules look only these up.
    moved: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "moved", frozenset(self.base).union(self.lifted, self.head))

    @property
    def active(self) -> bool:
        return bool(self.base or self.lifted or self.protected)


NONE = Limits()


def class_of(j: JobView, lim: Limits) -> int:
    """The class `j` is treated at: its own, or one down when its user is over that class's budget."""
    return lim.base.get(j.id, j.priority)


def level_class(j: JobView, lim: Limits) -> int:
    """The class the order and the preemption levels compare `j` at (see HEAD and FLOOR)."""
    if j.id in lim.lifted:
        return FLOOR
    c = lim.base.get(j.id, j.priority)
    return HEAD + c if j.id in lim.head else c


def budget_gpu_s(config) -> float:
    return config.class_budget_gpu_h * 3600.0


def over_budget(user: str, priority: int, usage: Mapping[tuple[str, int], float], config) -> bool:
    return priority in BUDGETED and usage.get((user, priority), 0.0) > budget_gpu_s(config)


def class_gpu_s(running: Mapping[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """The budgeted part of a period's service: `(user, class) -> GPU-seconds`, for `decay_usage`
    (the daemon and the simulator both keep `class_usage` with it)."""
    return {k: v for k, v in running.items() if k[1] in BUDGETED and v > 0}


def floor_gpus(snap: Snapshot) -> int:
    share = snap.config.class_floor_share
    if share <= 0:
        return 0
    if _HEALTHY[0] is not snap.gpus:        # the same GPUs call after call: counted once
        _HEALTHY[0], _HEALTHY[1] = snap.gpus, sum(1 for g in snap.gpus if g.healthy)
    return math.floor(share * _HEALTHY[1] + 1e-9)


def limits(snap: Snapshot, keys: Callable[[Sequence[JobView]], list[tuple]]) -> Limits:
    """The budget demotions and floors of `snap`. `keys`: the policy's order keys of many jobs (lower
    is more deserving), which pick the holders a floor protects and the waiting jobs it lifts; each
    key starts with its job's own class and ends with its id (unique). Within a class holding jobs
    a budget demoted into it, the order leaves that first element out. Runs on every decision: a
    few passes over the jobs (comprehensions: one loop with appends cost more), and the order of a
    class's waiting jobs only when the class is under its floor, taken from a heap as far as
    needed."""
    cfg = snap.config
    base: dict[str, int] = {}
    head: set[str] = set()
    if cfg.class_budget_gpu_h != math.inf:
        usage, budget = snap.class_usage, budget_gpu_s(cfg)
        for j in [j for j in snap.jobs if j.priority in BUDGETED]:     # few: above normal
            if usage.get((j.user, j.priority), 0.0) > budget:
                base[j.id] = j.priority - 1
            else:
                head.add(j.id)
    floor = floor_gpus(snap)
    if floor <= 0:
        return Limits(base, head=frozenset(head)) if base else NONE
    if not base:                            # the usual case, told cheaply: one class outside the head
        free_classes = {j.priority for j in snap.jobs}     # start, nothing to hold a floor against
        if len(free_classes.difference(BUDGETED) if head else free_classes) < 2:
            return NONE
    holding, queued, jobs = _HOLDING, _WAITING, snap.jobs
    # Comprehensions, not one loop: this runs on every decision, over every job.
    holder_jobs = [j for j in jobs if j.phase in holding or j.holds_gpu_while_paused]
    waiting_jobs = [j for j in jobs if j.phase in queued and not j.holds_gpu_while_paused]  # (a
    if head:                                # PAUSING job is leaving its GPUs: in neither)
        holder_jobs = [j for j in holder_jobs if j.id not in head]      # outside the floors
        waiting_jobs = [j for j in waiting_jobs if j.id not in head]
    holders: dict[int, list[JobView]] = defaultdict(list)
    for j in holder_jobs:
        holders[base.get(j.id, j.priority)].append(j)
    waiting_class = ([base.get(j.id, j.priority) for j in waiting_jobs] if base
                     else [j.priority for j in waiting_jobs])
    waiting = set(waiting_class)            # the classes with waiting jobs
    held_by = {c: sum(j.gpus for j in mine) for c, mine in holders.items()}
    present = set(holders) | waiting
    if len(present) < 2:
        return Limits(base, head=frozenset(head)) if base else NONE
    top = max(present)                      # the highest class present needs no floor
    within = _less_class if base else _as_is
    protected: list[str] = []
    lifted: list[str] = []
    for c in present:
        if c == top:
            continue
        held = 0                            # a job counts in while its class holds less than the
        if held_by.get(c, 0) <= floor:      # floor before it: a wide job too
            protected += [j.id for j in holders.get(c, ())]
            held = held_by.get(c, 0)
        else:
            mine = holders[c]
            for _, j in sorted(zip(within(keys(mine)), mine), key=_first):
                if held >= floor:
                    break
                held += j.gpus
                protected.append(j.id)
        if held < floor and c in waiting:
            mine = [j for j, k in zip(waiting_jobs, waiting_class) if k == c]
            heap = within(keys(mine))       # keys alone, not (key, index) pairs: a third the time
            heapify(heap)
            by_id = {j.id: j for j in mine}
            while heap and held < floor:
                j = by_id[heappop(heap)[-1]]
                held += j.gpus
                lifted.append(j.id)
    if not (base or protected or lifted):
        return NONE
    return Limits(base, frozenset(lifted), frozenset(protected), floor, frozenset(head))


def _first(pair: tuple) -> tuple:
    return pair[0]


def _as_is(keys: list[tuple]) -> list[tuple]:
    return keys


def _less_class(keys: list[tuple]) -> list[tuple]:
    return [k[1:] for k in keys]


def floor_refusal(w: JobView, v: JobView, lim: Limits) -> Optional[str]:
    """Why the floors forbid waiting `w` to pause `v`, or None. A protected job is paused only for
    its own class; a lifted job takes GPUs from other classes, not from its own (it is lifted to
    bring its class up to the floor, which pausing a sibling would not)."""
    cw, cv = class_of(w, lim), class_of(v, lim)
    if v.id in lim.protected and cw != cv and w.id not in lim.head:
        return (f"within the {_label(cv)} class's floor share ({lim.floor_gpus} GPU"
                f"{'s' if lim.floor_gpus != 1 else ''}): paused only for a job of its own class")
    if w.id in lim.lifted and cw == cv:
        return f"of its own class ({_label(cv)}): the floor lifts job {w.id} to take GPUs from other classes"
    return None


def describe(j: JobView, lim: Limits) -> str:
    """`j`'s class for a reason: `urgent`, `high (urgent over its user's budget)`, `low (below its
    class's floor share)`."""
    c = class_of(j, lim)
    text = _label(c)
    if c != j.priority:
        text += f" ({_label(j.priority)}, its user over the {_label(j.priority)} budget)"
    if j.id in lim.lifted:
        text += f", lifted: its class holds under its floor share of {lim.floor_gpus} GPU{'s' if lim.floor_gpus != 1 else ''}"
    return text


def _label(priority: int) -> str:
    try:
        return Priority(priority).label
    except ValueError:
        return f"priority {priority}"
