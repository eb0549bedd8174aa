"""Discrete-event simulator driven by the policy core: the same `decide` the daemon calls.

Events: arrivals, completions, park/restore completions, and wake-ups. `decide` runs once per
distinct event time, only while something waits (with nothing PENDING or PAUSED there is nothing to
start and no reason to preempt), plus a wake-up every `tick_s` while jobs wait under a preemptive
policy, so time-based rules (minimum runtimes lapsing, LAS thresholds, Gandiva quanta, starvation)
are seen between arrivals and completions, at most `tick_s` late.
Invariants are checked as it goes (SimError): no GPU double-booked, time never goes backwards,
decisions only for jobs in a phase that allows them, every job ends.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from gpuswap import lifecycle
from gpuswap.jobs import JobState
from gpuswap.lifecycle import EventKind as K
from gpuswap.policy import decide, decay_usage
from gpuswap.policy.capability import park_s, parkability, resume_s
from gpuswap.policy.classes import BUDGETED
from gpuswap.policy.estimate import Estimate, History
from gpuswap.policy.model import (GpuView, JobView, Pause, Phase, PolicyConfig, Resume, Snapshot,
                                  Spill, Start)
from gpuswap.sim.costmodel import CostModel, parse_cost_model
from gpuswap.sim.trace import TraceJob

_ARRIVE, _FINISH, _PARKED, _RESTORED, _WAKE = range(5)
# Each decision is the event of this kind in the lifecycle table (gpuswap/lifecycle.py): it fits a
# job whose phase has that edge, as in the daemon.
_DECISION_KIND = {Start: K.STARTED, Pause: K.PARK_STARTED, Resume: K.RESUME_STARTED, Spill: K.SPILL_REQUESTED}
_STATE = {p: JobState(p.value) for p in Phase}
_PHASE = {JobState(p.value): p for p in Phase}


class SimError(RuntimeError):
    """A broken invariant: a bug in the policy or the simulator, never a user error."""


@dataclass
class Cluster:
    nodes: int = 64
    gpus_per_node: int = 8
    ram_per_node: int = 256 * 1024**3       # host RAM budget for parked state, per node
    gpu_mem: int = 80 * 1024**3


@dataclass(slots=True, eq=False)
class SimJob:
    spec: TraceJob
    phase: Phase = Phase.PENDING
    phase_since: float = 0.0
    last_start: Optional[float] = None
    run_since: float = 0.0
    done: float = 0.0            # seconds of work completed
    attained: float = 0.0        # GPU-seconds of service
    switch_s: float = 0.0
    run_s: float = 0.0
    assigned: tuple[int, ...] = ()
    parked: Optional[str] = None
    parked_bytes: int = 0
    node: Optional[str] = None
    token: int = 0
    first_start: Optional[float] = None
    end: Optional[float] = None
    preemptions: int = 0
    tiers: frozenset = frozenset()   # what it can be parked to (policy/capability.py), fixed per run
    estimate: Optional[Estimate] = None   # made at its arrival from the runs finished before it


@dataclass
class SimResult:
    policy: str
    cost_model: str
    cluster: Cluster
    jobs: list[SimJob]
    makespan: float
    busy_gpu_s: float            # GPU-seconds of useful work
    switch_gpu_s: float          # GPU-seconds held while parking or restoring
    decide_calls: int
    events: int
    max_waiting: int
    usage: dict[str, float] = field(default_factory=dict)
    multi_rank: bool = True
    class_usage: dict[tuple[str, int], float] = field(default_factory=dict)   # policy/classes.py


class _RunningView(JobView):
    """A RUNNING job's view whose service counters are read off the simulator's clock.

    Building ~500 JobViews per event dominated the run time; a running job's only changing fields
    are its service counters, so its view is built once per run interval and those fields are
    computed on access. The clock stands still while `decide` runs, so the policy sees exactly
    what a freshly built snapshot would show.
    """

    __slots__ = ("_sim", "_job")

    @classmethod
    def make(cls, sim: "Simulator", j: "SimJob") -> "_RunningView":
        v = object.__new__(cls)
        s = j.spec
        values = dict(id=s.id, user=s.user, priority=s.priority, phase=j.phase, gpus=s.gpus,
                      mem_bytes=s.mem, submit_time=s.submit, phase_since=j.phase_since,
                      last_start=j.last_start, switch_s=j.switch_s, assigned=j.assigned,
                      parked=j.parked, parked_bytes=j.parked_bytes, preemptible=True,
                      tiers=j.tiers, holds_gpu_while_paused=False, node=j.node,
                      weight=s.weight, residue_bytes=0, width=s.gpus,   # no residue in the simulator
                      switches=j.preemptions, estimate_s=j.estimate.seconds if j.estimate else None)
        for name, value in values.items():
            _SLOT[name].__set__(v, value)
        object.__setattr__(v, "_sim", sim)
        object.__setattr__(v, "_job", j)
        return v

    @property
    def attained_gpu_s(self) -> float:  # type: ignore[override]
        j = self._job
        return j.attained + (self._sim.now - j.run_since) * j.spec.gpus

    @property
    def run_s(self) -> float:  # type: ignore[override]
        j = self._job
        return j.run_s + (self._sim.now - j.run_since)

    @property
    def remaining_s(self) -> Optional[float]:  # type: ignore[override]
        j = self._job
        return j.spec.duration - j.done - (self._sim.now - j.run_since) if self._sim.oracle else None


_SLOT = {name: JobView.__dict__[name] for name in JobView.__slots__}


class Simulator:
    def __init__(self, jobs: list[TraceJob], policy: str, cluster: Cluster = Cluster(),
                 cost_model: CostModel | str = "gpuswap", config: PolicyConfig = PolicyConfig(),
                 tick_s: float = 60.0, progress: Optional[Callable[[int, int], None]] = None,
                 multi_rank: bool = True, estimates: bool = True):
        self.policy = policy
        # Runtime estimates (policy/estimate.py), learnt as the run goes: a job is added to the
        # history when it completes and estimated when it arrives, so no estimate sees the future.
        self.history: Optional[History] = History() if estimates else None
        self.multi_rank = multi_rank
        self.progress = progress           # called now and then with (jobs finished, jobs)
        self.finished = 0
        self.cluster = cluster
        self.model = parse_cost_model(cost_model) if isinstance(cost_model, str) else cost_model
        self.config = config
        self.tick_s = tick_s
        wide = [j.id for j in jobs if j.gpus > cluster.gpus_per_node]
        if wide:
            raise ValueError(f"{len(wide)} job(s) need more GPUs than a node has ({cluster.gpus_per_node}), "
                             f"e.g. job {wide[0]}; load the trace with gpus_per_node={cluster.gpus_per_node}")
        self.jobs = [SimJob(j, phase_since=j.submit, tiers=self._tiers(j.gpus))
                     for j in sorted(jobs, key=lambda j: j.submit)]
        self.gpus = tuple(GpuView(n * cluster.gpus_per_node + i, f"n{n:03d}", cluster.gpu_mem)
                          for n in range(cluster.nodes) for i in range(cluster.gpus_per_node))
        self.node_of = {g.id: g.node for g in self.gpus}
        self.ram_budget = {f"n{n:03d}": cluster.ram_per_node for n in range(cluster.nodes)}
        self.owner: dict[int, SimJob] = {}
        self.live: dict[str, SimJob] = {}
        self.views: dict[str, JobView] = {}
        self.dirty: set[str] = set()
        self.waiting: set[str] = set()
        self.heap: list[tuple[float, int, int, Optional[SimJob], int]] = []
        self.seq = 0
        self.now = 0.0
        self.usage: dict[str, float] = {}
        self.gpus_by_user: dict[str, int] = defaultdict(int)
        # Decayed GPU-time per (user, class) of the budgeted classes (policy/classes.py).
        self.class_usage: dict[tuple[str, int], float] = {}
        self.gpus_by_class: dict[tuple[str, int], int] = defaultdict(int)
        self.last_usage_t = 0.0
        self.busy = self.switch_gpu_s = 0.0
        self.calls = self.events = self.max_waiting = 0
        self.wake_at = -math.inf           # time of the pending wake-up; none yet
        self.by_id = {j.spec.id: j for j in self.jobs}
        self.preemptive = policy not in ("fifo",)
        self.oracle = policy == "srtf-oracle"

    def _tiers(self, width: int) -> frozenset:
        """A trace job of w GPUs is a data-parallel job of w ranks with a cooperative runtime: what
        capability.py lets it park to, within what the cost model offers."""
        return parkability(width, "cooperative", "ddp", multi_rank=self.multi_rank).tiers & self.model.tiers

    # -- event plumbing ----------------------------------------------------------------------
    def _push(self, t: float, kind: int, job: Optional[SimJob] = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, job, job.token if job else 0))

    def _set_phase(self, j: SimJob, phase: Phase, kind: K, new: bool = False) -> None:
        """Move `j` (`new`: just arrived) by an event of `kind`, which the lifecycle table must allow."""
        try:
            to = lifecycle.target(None if new else _STATE[j.phase], kind)
        except lifecycle.IllegalTransition as e:
            raise SimError(f"t={self.now}: job {j.spec.id}: {e}") from None
        if _PHASE.get(to) is not phase:
            raise SimError(f"t={self.now}: job {j.spec.id}: {kind.value} leads to {to.value}, not {phase.value}")
        j.phase, j.phase_since = phase, self.now
        self.dirty.add(j.spec.id)
        if phase in (Phase.PENDING, Phase.PAUSED):
            self.waiting.add(j.spec.id)
        else:
            self.waiting.discard(j.spec.id)

    def _hold(self, j: SimJob, gpus: tuple[int, ...]) -> None:
        nodes = {self.node_of.get(g) for g in gpus}
        if len(gpus) != j.spec.gpus or len(set(gpus)) != len(gpus) or len(nodes) != 1 or None in nodes:
            raise SimError(f"t={self.now}: job {j.spec.id} given GPUs {gpus} (needs {j.spec.gpus} on one node)")
        for g in gpus:
            if g in self.owner:
                raise SimError(f"t={self.now}: GPU {g} double-booked: job {self.owner[g].spec.id} "
                               f"and job {j.spec.id}")
            self.owner[g] = j
        j.assigned = gpus

    def _release(self, j: SimJob) -> None:
        for g in j.assigned:
            del self.owner[g]
        j.assigned = ()

    def _begin_run(self, j: SimJob, kind: K) -> None:
        self._set_phase(j, Phase.RUNNING, kind)
        j.last_start = j.run_since = self.now
        if j.first_start is None:
            j.first_start = self.now
        self.gpus_by_user[j.spec.user] += j.spec.gpus
        if j.spec.priority in BUDGETED:
            self.gpus_by_class[(j.spec.user, j.spec.priority)] += j.spec.gpus
        self._push(self.now + (j.spec.duration - j.done), _FINISH, j)

    def _stop_run(self, j: SimJob) -> None:
        ran = self.now - j.run_since
        j.done += ran
        j.run_s += ran
        j.attained += ran * j.spec.gpus
        self.busy += ran * j.spec.gpus
        self.gpus_by_user[j.spec.user] -= j.spec.gpus
        if j.spec.priority in BUDGETED:
            self.gpus_by_class[(j.spec.user, j.spec.priority)] -= j.spec.gpus
        j.token += 1                       # cancels its pending FINISH

    # -- decisions ---------------------------------------------------------------------------
    def _view(self, j: SimJob) -> JobView:
        """The job's view, rebuilt only when its phase changes (see _RunningView for RUNNING jobs)."""
        s = j.spec
        if j.phase == Phase.RUNNING:
            return _RunningView.make(self, j)
        return JobView(s.id, s.user, s.priority, j.phase, s.gpus, s.mem, s.submit, j.phase_since,
                       j.last_start, j.attained, j.switch_s, j.run_s, j.assigned, j.parked,
                       j.parked_bytes, True, j.tiers, False, j.node, s.weight,
                       (s.duration - j.done) if self.oracle else None, width=s.gpus, switches=j.preemptions,
                       estimate_s=j.estimate.seconds if j.estimate else None)

    def _decide(self) -> bool:
        dt = self.now - self.last_usage_t
        if dt > 0:
            self.usage = decay_usage(self.usage, dt, {u: g * dt for u, g in self.gpus_by_user.items() if g},
                                     self.config.fair_share_half_life_s)
            if self.class_usage or any(self.gpus_by_class.values()):
                self.class_usage = decay_usage(
                    self.class_usage, dt, {k: g * dt for k, g in self.gpus_by_class.items() if g},
                    self.config.class_half_life_s)
            self.last_usage_t = self.now
        for jid in self.dirty:
            self.views[jid] = self._view(self.live[jid])
        self.dirty.clear()
        snap = Snapshot(self.now, self.gpus, tuple(self.views.values()),
                        self.model.costs, self.config, self.ram_budget, self.usage, self.class_usage)
        self.calls += 1
        spilled = False
        for d in decide(snap, self.policy):
            j = self.live.get(d.job_id)
            if j is None:
                raise SimError(f"t={self.now}: decision for unknown or finished job {d.job_id}")
            if isinstance(d, Start):
                self._expect(j, d)
                self._hold(j, d.gpus)
                self._begin_run(j, K.STARTED)
            elif isinstance(d, Pause):
                self._expect(j, d)
                self._stop_run(j)
                self._set_phase(j, Phase.PAUSING, K.PARK_STARTED)
                nbytes = j.spec.mem * j.spec.gpus
                cost = park_s(self.model.costs, nbytes, d.tier, j.spec.gpus)
                j.parked, j.parked_bytes, j.node = d.tier, nbytes, self.node_of[j.assigned[0]]
                j.switch_s += cost
                j.preemptions += 1
                self.switch_gpu_s += cost * j.spec.gpus
                self._push(self.now + cost, _PARKED, j)
            elif isinstance(d, Resume):
                self._expect(j, d)
                if j.parked == "ram" and self.node_of.get(d.gpus[0] if d.gpus else -1) != j.node:
                    raise SimError(f"t={self.now}: RAM-parked job {j.spec.id} resumed off its node {j.node}")
                self._hold(j, d.gpus)
                self._set_phase(j, Phase.RESUMING, K.RESUME_STARTED)
                cost = resume_s(self.model.costs, j.parked_bytes, j.parked or "disk", j.spec.gpus)
                j.switch_s += cost
                self.switch_gpu_s += cost * j.spec.gpus
                self._push(self.now + cost, _RESTORED, j)
            elif isinstance(d, Spill):
                self._expect(j, d)
                j.parked = "disk"                   # host-side copy: costs no GPU time
                self.dirty.add(j.spec.id)
                spilled = True
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        return spilled

    def _expect(self, j: SimJob, d) -> None:
        if not lifecycle.allows(_STATE[j.phase], _DECISION_KIND[type(d)]):
            raise SimError(f"t={self.now}: {type(d).__name__} for job {j.spec.id} in phase {j.phase.value}")

    def _handle(self, kind: int, j: Optional[SimJob], token: int) -> bool:
        """Apply one event; True when it could change what the policy would decide.

        A finished restore frees nothing: the job's GPUs were held while it resumed and stay held,
        and its parked RAM was already off the budget. It only makes the job RUNNING, a possible
        victim once its minimum runtime (counted from now) lapses -- a time-based rule, seen at the
        next event or tick like the others. Not deciding on it saves ~18% of gpuswap's decisions on
        the Philly trace.
        """
        if kind == _ARRIVE:
            if self.history is not None:
                j.estimate = self.history.estimate(j.spec.user, j.spec.name)
            self.live[j.spec.id] = j
            self._set_phase(j, Phase.PENDING, K.SUBMITTED, new=True)
        elif kind == _FINISH:
            if token != j.token:
                return False                 # stale: the job was paused since
            self._stop_run(j)
            self._release(j)
            j.end = self.now
            if self.history is not None:
                self.history.add(j.spec.user, j.spec.name, j.run_s)
            self.finished += 1
            if self.progress is not None and self.finished % 500 == 0:
                self.progress(self.finished, len(self.jobs))
            j.phase = Phase.RUNNING
            del self.live[j.spec.id]
            self.views.pop(j.spec.id, None)
            self.dirty.discard(j.spec.id)
        elif kind == _PARKED:
            self._release(j)
            self._set_phase(j, Phase.PAUSED, K.PARKED_RAM if j.parked == "ram" else K.PARKED_DISK)
        elif kind == _RESTORED:
            kind = K.RESUMED_RAM if j.parked == "ram" else K.RESTARTED_DISK
            j.parked, j.parked_bytes = None, 0
            self._begin_run(j, kind)
            return False                     # frees nothing: see the docstring
        return True

    def _schedule_wake(self) -> None:
        """While jobs wait under a preemptive policy, look again every tick_s: minimum runtimes
        lapse, LAS thresholds are crossed, quanta end. (Waking at each minimum-runtime expiry was
        exact but doubled the number of decide calls on the Philly trace.)"""
        if not self.preemptive or not self.waiting or self.wake_at > self.now:
            return
        self.wake_at = self.now + self.tick_s
        self._push(self.wake_at, _WAKE)

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> SimResult:
        arrivals = iter(self.jobs)
        nxt = next(arrivals, None)
        while nxt is not None or self.heap:
            t = min(nxt.spec.submit if nxt is not None else math.inf,
                    self.heap[0][0] if self.heap else math.inf)
            if t < self.now:
                raise SimError(f"time went backwards: {t} < {self.now}")
            self.now = t
            changed = False
            while nxt is not None and nxt.spec.submit <= t:
                changed |= self._handle(_ARRIVE, nxt, 0)
                self.events += 1
                nxt = next(arrivals, None)
            while self.heap and self.heap[0][0] <= t:
                _, _, kind, j, token = heapq.heappop(self.heap)
                self.events += 1
                changed |= self._handle(kind, j, token) if kind != _WAKE else True
            if changed and self.waiting:
                for _ in range(3):          # a Spill (RAM -> disk, instant here) frees the job to
                    if not self._decide():  # resume on another node: ask again at the same time
                        break
                self._schedule_wake()
                if nxt is None and not self.owner and all(e[2] == _WAKE for e in self.heap):
                    raise SimError(f"t={self.now}: {len(self.waiting)} job(s) wait on an idle cluster "
                                   "and the policy starts none (stuck)")
        unfinished = [j.spec.id for j in self.jobs if j.end is None]
        if unfinished:
            raise SimError(f"{len(unfinished)} job(s) never finished, e.g. {unfinished[:5]}")
        if self.owner:
            raise SimError(f"GPUs still held at the end: {sorted(self.owner)[:8]}")
        makespan = max(j.end for j in self.jobs) - min(j.spec.submit for j in self.jobs)
        return SimResult(self.policy, self.model.name, self.cluster, self.jobs, makespan, self.busy,
                         self.switch_gpu_s, self.calls, self.events, self.max_waiting, self.usage,
                         self.multi_rank, self.class_usage)


def simulate(jobs: list[TraceJob], policy: str, **kw) -> SimResult:
    return Simulator(jobs, policy, **kw).run()
