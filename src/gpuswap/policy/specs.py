"""What a policy is, and the published ones: each a few small rules plugged into the one engine in
`engine.py`.

A policy says (1) in which order waiting jobs are served, (2) its preemption level -- a waiting
job may pause a running one only if its level is strictly lower, (3) which eligible victim goes
first, and (4) optional extra gates (switch-fraction cap, benefit-versus-cost). Placement, the
minimum runtime, in-flight pauses, tiers and RAM budgets are handled once, in the engine.
Here: `Spec` and `Ctx`, the helpers policies share (attained service, LAS queues), and the rules of
fifo, priority, las, gandiva and srtf-oracle. gpuswap's own rules: `gpuswap.py`; the table of
policies by name: `policies.py`.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Optional, Sequence

from gpuswap.jobs import Priority
from gpuswap.policy import classes
from gpuswap.policy.classes import Limits, level_class
from gpuswap.policy.model import JobView, Phase, PolicyConfig, SwitchCosts

Key = tuple


@dataclass(frozen=True, slots=True)
class Ctx:
    """What the rules may look at besides the job itself (all from the snapshot)."""

    now: float
    config: PolicyConfig
    costs: SwitchCosts
    usage: Mapping[str, float]
    lim: Limits = classes.NONE       # classes with limits (policy/classes.py): gpuswap only
    # Order keys this decision already worked out, by job id, each at the job's own class: the
    # class limits order a class's jobs to pick whom a floor lifts or protects (`make_ctx`), and
    # the round's queue takes those keys rather than working them out again (`Spec.orders`).
    known: Mapping[str, Key] = field(default_factory=dict)


@dataclass(frozen=True)
class Spec:
    name: str
    preemptive: bool
    order: Callable[[JobView, Ctx], Key]                 # lower is served first
    level: Callable[[JobView, Ctx], Key]                 # w may pause v only if level(w) < level(v)
    victim: Callable[[JobView, Ctx, float], Key]         # lower is paused first (float: switch cost s)
    why: Callable[[JobView, JobView, Ctx], str]          # reason shown on the victim's event
    switch_cap: bool = False                             # honour config.max_switch_fraction
    benefit_ok: Optional[Callable[[JobView, JobView, Ctx, float], bool]] = None
    # How benefit_ok depends on the waiting job: (group, rank), where within a group a job of higher
    # rank never gains more from a switch than one of lower rank. A round that found no plan for a
    # job finds none for a later one (level at least as high) of the same group and GPUs with a
    # rank at least as high, and does not look again: the simulator's queues are long. benefit_ok
    # reads the waiting job only through it (equal (group, rank), equal answers): a round keeps its
    # victim plans per rank (preemption.py; tests/policy/test_policy_round.py).
    benefit_rank: Callable[[JobView, Ctx], tuple[Hashable, float]] = lambda w, c: ((), 0.0)
    sim_only: bool = False
    # Optional batch forms of `order` (waiting jobs) and `level` (RUNNING jobs only), same values:
    # the engine calls them over every job on every call, where a call per job is the cost.
    orders: Optional[Callable[[Sequence[JobView], Ctx], list[Key]]] = None
    running_levels: Optional[Callable[[Sequence[JobView], Ctx], list[Key]]] = None
    level_prefix: int = 0     # when > 0, a waiting job's level is order(...)[:level_prefix] (saves a call)
    # Optional: whether no waiting job's level is below `bound` (the highest victim's level), found
    # without ordering the queue and stopping at the first that is. When it holds on a full cluster,
    # nobody can be served and the round is skipped: with a deep queue most calls are such.
    none_below: Optional[Callable[[Sequence[JobView], Ctx, Key], bool]] = None
    # Optional: the waiting jobs whose level is below `bound`, in their order in `jobs` (empty
    # exactly when `none_below` holds). On a full cluster the round then orders only these and
    # the RAM-parked (engine.py, `_Round._waiting`): one cheap pass instead of every job's key.
    below: Optional[Callable[[Sequence[JobView], Ctx, Key], list[JobView]]] = None
    # Reservations for jobs that waited past config.reserve_after_s (issue 15, item 2; reservation.py).
    # gpuswap only: the other policies reproduce published schemes (Tiresias, Gandiva, FIFO with
    # backfill) that do not reserve, and their tables are compared with those schemes' own.
    reserves: bool = False
    # Whether the policy applies the class limits (budgets and floors, policy/classes.py).
    class_limits: bool = False


def label(priority: int) -> str:
    try:
        return Priority(priority).label
    except ValueError:
        return f"priority {priority}"


WAITING = frozenset({Phase.PENDING, Phase.PAUSED})


def service_s(job: JobView) -> float:
    """Attained service per GPU (GPU-seconds / GPUs): how long the job has run, whatever its width."""
    return job.attained_gpu_s / (job.gpus if job.gpus > 1 else 1)


def las_queue(job: JobView, ctx: Ctx, thresholds: Optional[tuple[float, ...]] = None,
              per_gpu: bool = False) -> int:
    """Tiresias' discretized 2D-LAS queue: 0 below the first threshold of attained GPU-seconds, etc.

    `thresholds` defaults to the `las` policy's (`config.las_thresholds_gpu_s`); gpuswap passes its
    own finer bands, over service per GPU (`per_gpu`). Starvation (Tiresias' STARVELIMIT): a waiting
    job that has waited `las_starvation_factor` x its executed time is promoted to queue 0. Executed
    time is the job's cumulative run time (as in the Tiresias simulator), so a long job's promotion
    wait grows with it and promotion cannot ping-pong.
    """
    q = bisect_right(ctx.config.las_thresholds_gpu_s if thresholds is None else thresholds,
                     service_s(job) if per_gpu else job.attained_gpu_s)   # 0 below the first threshold
    return 0 if q and starving(job, ctx) else q


def starving(job: JobView, ctx: Ctx) -> bool:
    """Tiresias' STARVELIMIT: waited `las_starvation_factor` x its cumulative run time."""
    return (job.phase in WAITING and job.run_s > 0
            and ctx.now - job.phase_since >= ctx.config.las_starvation_factor * job.run_s)


def since_start(job: JobView) -> float:
    return job.last_start if job.last_start is not None else job.phase_since


# fifo -------------------------------------------------------------------------------------------
def _fifo_order(j: JobView, c: Ctx) -> Key:
    return (j.submit_time, j.id)


# priority ---------------------------------------------------------------------------------------
def _prio_order(j: JobView, c: Ctx) -> Key:
    return (-j.priority, j.submit_time, j.id)


def _prio_orders(jobs: Sequence[JobView], c: Ctx) -> list[Key]:
    return [(-j.priority, j.submit_time, j.id) for j in jobs]


def _fifo_orders(jobs: Sequence[JobView], c: Ctx) -> list[Key]:
    return [(j.submit_time, j.id) for j in jobs]


def _prio_level(j: JobView, c: Ctx) -> Key:
    return (-j.priority,)


def _prio_none_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> bool:
    return not jobs or (-max([j.priority for j in jobs]),) >= bound


def _prio_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> list[JobView]:
    top = -bound[0]
    return [j for j in jobs if j.priority > top]


def _prio_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (v.priority, -since_start(v), v.id)      # lowest class, then the most recently started


def _prio_why(w: JobView, v: JobView, c: Ctx) -> str:
    return f"preempted by job {w.id} ({label(w.priority)})"


# las (Tiresias 2D-LAS, discretized) -------------------------------------------------------------
def _las_order(j: JobView, c: Ctx) -> Key:
    return (las_queue(j, c), j.submit_time, j.id)


def _las_orders(jobs: Sequence[JobView], c: Ctx) -> list[Key]:
    """`_las_order` of many jobs, `las_queue` written out: the order of every waiting job is
    computed on every call, and with a deep queue that is most of a call (tested equal)."""
    now, factor, th, waiting = c.now, c.config.las_starvation_factor, c.config.las_thresholds_gpu_s, WAITING
    out: list[Key] = []
    append = out.append
    for j in jobs:
        q = bisect_right(th, j.attained_gpu_s)
        if q and j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            q = 0                           # starving: promoted
        append((q, j.submit_time, j.id))
    return out


def _las_level(j: JobView, c: Ctx) -> Key:
    return (las_queue(j, c),)


def _las_none_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> bool:
    """Every waiting job's LAS queue is at least bound's: `las_queue` written out, stopping early."""
    q_min = bound[0]
    if q_min <= 0:
        return True
    now, factor, waiting = c.now, c.config.las_starvation_factor, WAITING
    below = c.config.las_thresholds_gpu_s[q_min - 1]      # attained service under this: a lower queue
    for j in jobs:
        if j.attained_gpu_s < below:
            return False
        if j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            return False                    # starving: promoted to queue 0
    return True


def _las_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> list[JobView]:
    """The jobs whose LAS queue is below bound's (`las_queue` written out, as in `_las_none_below`)."""
    q_min = bound[0]
    if q_min <= 0:
        return []
    now, factor, waiting = c.now, c.config.las_starvation_factor, WAITING
    below = c.config.las_thresholds_gpu_s[q_min - 1]
    return [j for j in jobs if j.attained_gpu_s < below
            or (j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s)]


def joined_queue_at(v: JobView, c: Ctx, q: int) -> float:
    """When RUNNING job `v` joined the running jobs of LAS queue `q`: its last start or resume, or
    the moment its service crossed into `q` if that came later (seen as service beyond the
    threshold, counted back at its width)."""
    started = since_start(v)
    if not q:
        return started
    crossed = c.now - (v.attained_gpu_s - c.config.las_thresholds_gpu_s[q - 1]) / (v.gpus if v.gpus > 1 else 1)
    return crossed if crossed > started else started


def _las_victim(v: JobView, c: Ctx, cost: float) -> Key:
    """Lowest queue first; inside it, the job that joined that queue's running jobs last (Tiresias'
    simulator keeps each queue as a list with its running jobs first and preempts from the tail,
    so the job that started, resumed or was demoted into it last goes first)."""
    q = las_queue(v, c)
    return (-q, -joined_queue_at(v, c, q), -v.submit_time, v.id)


def _las_why(w: JobView, v: JobView, c: Ctx) -> str:
    return (f"preempted by job {w.id} (less attained service: LAS queue {las_queue(w, c)} "
            f"< {las_queue(v, c)})")


# gandiva (round-robin time slicing) -------------------------------------------------------------
def _gandiva_order(j: JobView, c: Ctx) -> Key:
    return (j.phase_since, j.submit_time, j.id)      # longest waiting first: round robin


def _gandiva_level(j: JobView, c: Ctx) -> Key:
    if j.phase in (Phase.PENDING, Phase.PAUSED):
        return (1,)
    expired = c.now - since_start(j) >= c.config.gandiva_quantum_s
    return (2,) if expired else (0,)


def _gandiva_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (since_start(v), v.id)                  # the slice that began first ends first


def _gandiva_why(w: JobView, v: JobView, c: Ctx) -> str:
    return f"time slice of {c.config.gandiva_quantum_s:.0f}s over; job {w.id} is waiting"


# srtf-oracle ------------------------------------------------------------------------------------
def _remaining(j: JobView) -> float:
    if j.remaining_s is None:
        raise ValueError(f"policy 'srtf-oracle' needs remaining_s for every job (job {j.id} has none); "
                         "it is a simulator-only lower bound")
    return j.remaining_s


def _srtf_order(j: JobView, c: Ctx) -> Key:
    return (_remaining(j), j.submit_time, j.id)


def _srtf_level(j: JobView, c: Ctx) -> Key:
    return (_remaining(j),)


def _srtf_none_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> bool:
    return all((_remaining(j),) >= bound for j in jobs)


def _srtf_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> list[JobView]:
    return [j for j in jobs if (_remaining(j),) < bound]


def _srtf_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (-_remaining(v), v.id)


def _srtf_why(w: JobView, v: JobView, c: Ctx) -> str:
    return f"preempted by job {w.id} (shorter remaining time)"


def band_levels(thresholds: Callable[[PolicyConfig], tuple[float, ...]], by_class: bool,
                per_gpu: bool = False):
    """Levels of RUNNING jobs at once, (band,) or (class, band): a running job is never starving,
    so its band is its attained service against the thresholds (las_queue without promotion). A
    running job is never lifted: its class is its own or, over a budget, one down."""
    def levels(running: Sequence[JobView], c: Ctx) -> list[Key]:
        th = thresholds(c.config)
        bands = [bisect_right(th, j.attained_gpu_s / j.gpus if per_gpu and j.gpus > 1 else j.attained_gpu_s)
                 for j in running]          # service_s(j) written out when per_gpu: hot
        if not by_class:
            return [(b,) for b in bands]
        lim = c.lim
        if lim.active:
            return [(-level_class(j, lim), b) for j, b in zip(running, bands)]
        return [(-j.priority, b) for j, b in zip(running, bands)]
    return levels


FIFO = Spec("fifo", False, _fifo_order, _prio_level, _prio_victim, _prio_why, orders=_fifo_orders)
PRIORITY = Spec("priority", True, _prio_order, _prio_level, _prio_victim, _prio_why,
                level_prefix=1, orders=_prio_orders, none_below=_prio_none_below, below=_prio_below)
LAS = Spec("las", True, _las_order, _las_level, _las_victim, _las_why, level_prefix=1, orders=_las_orders,
           none_below=_las_none_below, below=_las_below,
           running_levels=band_levels(lambda cfg: cfg.las_thresholds_gpu_s, by_class=False))
GANDIVA = Spec("gandiva", True, _gandiva_order, _gandiva_level, _gandiva_victim, _gandiva_why,
               none_below=lambda jobs, c, bound: (1,) >= bound)   # every waiting job's level is (1,)
SRTF_ORACLE = Spec("srtf-oracle", True, _srtf_order, _srtf_level, _srtf_victim, _srtf_why,
                   sim_only=True, level_prefix=1, none_below=_srtf_none_below,
                   below=_srtf_below)
