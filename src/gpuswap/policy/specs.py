"""The policies, each as a few small rules plugged into the one engine in `engine.py`.

A policy says (1) in which order waiting jobs are served, (2) its preemption level -- a waiting
job may pause a running one only if its level is strictly lower, (3) which eligible victim goes
first, and (4) optional extra gates (switch-fraction cap, benefit-versus-cost). Placement, the
minimum runtime, in-flight pauses, tiers and RAM budgets are handled once, in the engine.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Sequence

from gpuswap.jobs import Priority
from gpuswap.policy import classes
from gpuswap.policy.classes import FLOOR, HEAD, Limits, class_of, level_class
from gpuswap.policy.fairshare import share_key
from gpuswap.policy.model import JobView, Phase, PolicyConfig, Snapshot, SwitchCosts

Key = tuple


@dataclass(frozen=True, slots=True)
class Ctx:
    """What the rules may look at besides the job itself (all from the snapshot)."""

    now: float
    config: PolicyConfig
    costs: SwitchCosts
    usage: Mapping[str, float]
    lim: Limits = classes.NONE       # classes with limits (policy/classes.py): gpuswap only


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
    # Reservations for jobs that waited past config.reserve_after_s (issue 15, item 2; engine.py).
    # gpuswap only: the other policies reproduce published schemes (Tiresias, Gandiva, FIFO with
    # backfill) that do not reserve, and their tables are compared with those schemes' own.
    reserves: bool = False
    # Whether the policy applies the class limits (budgets and floors, policy/classes.py).
    class_limits: bool = False


def make_ctx(snap: Snapshot, spec: Spec) -> Ctx:
    """The rules' view of `snap`; for a policy with class limits, what they make of it."""
    ctx = Ctx(snap.now, snap.config, snap.costs, snap.usage)
    if not spec.class_limits:
        return ctx
    lim = classes.limits(snap, lambda jobs: [k[1:] for k in _gs_orders(jobs, ctx)])
    return ctx if lim is classes.NONE else Ctx(snap.now, snap.config, snap.costs, snap.usage, lim)


def label(priority: int) -> str:
    try:
        return Priority(priority).label
    except ValueError:
        return f"priority {priority}"


_WAITING = frozenset({Phase.PENDING, Phase.PAUSED})


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
    return (job.phase in _WAITING and job.run_s > 0
            and ctx.now - job.phase_since >= ctx.config.las_starvation_factor * job.run_s)


def _since_start(job: JobView) -> float:
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


def _prio_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (v.priority, -_since_start(v), v.id)      # lowest class, then the most recently started


def _prio_why(w: JobView, v: JobView, c: Ctx) -> str:
    return f"preempted by job {w.id} ({label(w.priority)})"


# las (Tiresias 2D-LAS, discretized) -------------------------------------------------------------
def _las_order(j: JobView, c: Ctx) -> Key:
    return (las_queue(j, c), j.submit_time, j.id)


def _las_orders(jobs: Sequence[JobView], c: Ctx) -> list[Key]:
    """`_las_order` of many jobs, `las_queue` written out: the order of every waiting job is
    computed on every call, and with a deep queue that is most of a call (tested equal)."""
    now, factor, th, waiting = c.now, c.config.las_starvation_factor, c.config.las_thresholds_gpu_s, _WAITING
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
    now, factor, waiting = c.now, c.config.las_starvation_factor, _WAITING
    below = c.config.las_thresholds_gpu_s[q_min - 1]      # attained service under this: a lower queue
    for j in jobs:
        if j.attained_gpu_s < below:
            return False
        if j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            return False                    # starving: promoted to queue 0
    return True


def joined_queue_at(v: JobView, c: Ctx, q: int) -> float:
    """When RUNNING job `v` joined the running jobs of LAS queue `q`: its last start or resume, or
    the moment its service crossed into `q` if that came later (seen as service beyond the
    threshold, counted back at its width)."""
    started = _since_start(v)
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
    expired = c.now - _since_start(j) >= c.config.gandiva_quantum_s
    return (2,) if expired else (0,)


def _gandiva_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (_since_start(v), v.id)                  # the slice that began first ends first


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


def _srtf_victim(v: JobView, c: Ctx, cost: float) -> Key:
    return (-_remaining(v), v.id)


def _srtf_why(w: JobView, v: JobView, c: Ctx) -> str:
    return f"preempted by job {w.id} (shorter remaining time)"


# gpuswap ----------------------------------------------------------------------------------------
def gs_band(j: JobView, c: Ctx) -> int:
    """gpuswap's LAS band: `las_queue` over its own finer thresholds (config.gpuswap_bands_s), on
    service per GPU. GPU-seconds (Tiresias' 2D) put an 8-GPU job 8x further back per hour run: on
    the Philly trace day-long 8-GPU jobs then waited for whole nodes behind everything else and made
    the entire gap to the SRTF oracle (policies.md)."""
    return las_queue(j, c, c.config.gpuswap_bands_s, per_gpu=True)


def expected_left(j: JobView) -> float:
    """Seconds the job is expected to run still: its estimate less its run time while that is > 0;
    otherwise (no estimate, or outlived it) LAS's heavy-tail predictor, its service per GPU -- a
    job that has run s seconds needs about s more. One unit, so both kinds of job compare."""
    e = j.estimate_s
    if e is not None:
        left = e - j.run_s
        if left > 0:
            return left
    return service_s(j)


def left_band(j: JobView, band: int, c: Ctx) -> int:
    """Where the job's expected remaining time falls on the band thresholds: for a job ranked by its
    service (no estimate, or outlived it), its band itself, so within a band such jobs keep the
    order they had before estimates came (share, then service; cheapest victim first); a job with
    a live estimate moves ahead of them (nearly done) or behind (much left)."""
    e = j.estimate_s
    if e is not None:
        left = e - j.run_s
        if left > 0:
            return bisect_right(c.config.gpuswap_bands_s, left)
    return band


def _gs_orders(jobs: Sequence[JobView], c: Ctx) -> list[Key]:
    """Class, then LAS band, then expected remaining time on the band scale (`left_band`), then the
    least-served user (decayed usage / weight), then expected remaining time (`expected_left`).

    The order starts with the preemption level on purpose: if a user's share could put a job ahead
    of one that may preempt it, the two would swap every minimum runtime (on the first 5,000 Philly
    jobs that ordering caused ~290k preemptions). (`gs_band`, `share_key` and `service_s` written
    out: this runs for every waiting job on every call; tested equal to `_gs_order`.)
    """
    usage, now, factor, th, waiting = c.usage, c.now, c.config.las_starvation_factor, c.config.gpuswap_bands_s, _WAITING
    lim = c.lim
    limited = lim.active
    base, lifted, head = lim.base, lim.lifted, lim.head
    out: list[Key] = []
    append = out.append
    for j in jobs:
        s = j.attained_gpu_s
        if j.gpus > 1:
            s = s / j.gpus
        band = bisect_right(th, s)
        if band and j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            band = 0                        # starving: promoted
        w = j.weight
        if limited:                         # gs_class written out
            p = FLOOR if j.id in lifted else base.get(j.id, j.priority) + (HEAD if j.id in head else 0)
        else:
            p = j.priority
        e = j.estimate_s
        lb, left = band, s
        if e is not None and e > j.run_s:   # a live estimate (expected_left, left_band written out)
            left = e - j.run_s
            lb = bisect_right(th, left)
        append((-p, band, lb, usage.get(j.user, 0.0) / (w if w > 1e-9 else 1e-9), left, j.submit_time, j.id))
    return out


def gs_class(j: JobView, c: Ctx) -> int:
    """The class gpuswap orders and compares `j` at: its own, one down over its user's budget,
    FLOOR when lifted into its class's floor share, above it for a head start (policy/classes.py)."""
    return level_class(j, c.lim) if c.lim.active else j.priority


def _gs_order(j: JobView, c: Ctx) -> Key:
    """One job's key, as `_gs_orders` gives it for many (the readable form; tested equal)."""
    band = gs_band(j, c)
    return (-gs_class(j, c), band, left_band(j, band, c), share_key(c.usage, j.user, j.weight), expected_left(j),
            j.submit_time, j.id)


def _gs_level(j: JobView, c: Ctx) -> Key:
    return (-gs_class(j, c), gs_band(j, c))


def _gs_none_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> bool:
    """Every waiting job's (class, band) is at least bound's: no higher class, and in bound's class
    no lower band (`gs_band` written out for that class only, stopping early)."""
    top, b_min = -bound[0], bound[1]
    now, factor, th, waiting = c.now, c.config.las_starvation_factor, c.config.gpuswap_bands_s, _WAITING
    below = th[b_min - 1] if b_min > 0 else 0.0          # service per GPU under this: a lower band
    lim = c.lim
    for j in jobs:
        p = j.priority if not lim.active else gs_class(j, c)
        if p > top:
            return False
        if p < top or b_min <= 0:
            continue
        s = j.attained_gpu_s
        if j.gpus > 1:
            s = s / j.gpus
        if s < below:
            return False
        if j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            return False                    # starving: promoted to band 0
    return True


def _band_levels(thresholds: Callable[[PolicyConfig], tuple[float, ...]], by_class: bool,
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


def _gs_victim(v: JobView, c: Ctx, cost: float) -> Key:
    """The job the order ranks last goes first: lowest class, highest band, most expected remaining
    time on the band scale (`left_band`: a job its estimate says is nearly done goes last); then the
    cheapest to park, the user most over their share, and the longest since its last switch (a job
    that has just been resumed is the most expensive to move again)."""
    band = gs_band(v, c)
    return (gs_class(v, c), -band, -left_band(v, band, c), round(cost, 1), -share_key(c.usage, v.user, v.weight),
            _since_start(v), v.id)


def _gs_benefit(w: JobView, v: JobView, c: Ctx, cost: float) -> bool:
    """A higher class or a starving job (promoted to band 0) always may preempt; within a class
    otherwise only when the expected gain beats the cost.

    The gain is what SRTF would gain: v's expected remaining time - w's (`expected_left`: the
    estimate's remainder where there is one, else LAS's heavy-tail predictor -- a job that has run s
    seconds will need about s more -- in the unit the bands use, service per GPU), against the
    seconds the round trip costs v. A job its estimate says is nearly done is not paused for one
    with more left. (Gate and bands must agree: when they used different units, the
    band let a job preempt, the gate refused, and the freed GPUs went to it anyway through the
    order -- twice the switches.)
    """
    lim = c.lim
    if lim.active:
        if classes.floor_refusal(w, v, lim) is not None:
            return False            # a floor: protected from other classes; a lifted job takes from them
        if w.id in lim.lifted:
            return True             # a promise, like a class: its class is under its floor
        if gs_class(w, c) > gs_class(v, c) or starving(w, c):
            return True
    elif w.priority > v.priority or starving(w, c):
        return True                 # a promise, like a class: promotion must be able to run the job
    return expected_left(v) - expected_left(w) >= c.config.switch_benefit_factor * cost


def _gs_benefit_rank(w: JobView, c: Ctx) -> tuple[Hashable, float]:
    rank = float("-inf") if starving(w, c) else expected_left(w)
    if c.lim.active:                # lifted or not, and the class it is treated at
        return (gs_class(w, c), class_of(w, c.lim), w.id in c.lim.head), rank
    return w.priority, rank


def _gs_why(w: JobView, v: JobView, c: Ctx) -> str:
    lim = c.lim
    cv = class_of(v, lim)
    if gs_class(w, c) > gs_class(v, c):
        why = f"preempted by job {w.id} ({classes.describe(w, lim)})"
        if cv != v.priority:
            why += f"; this job counts as {label(cv)}: its user is over the {label(v.priority)} budget"
        return why
    return (f"preempted by job {w.id} (same class, less attained service: band "
            f"{gs_band(w, c)} < {gs_band(v, c)})")


SPECS: dict[str, Spec] = {
    "fifo": Spec("fifo", False, _fifo_order, _prio_level, _prio_victim, _prio_why, orders=_fifo_orders),
    "priority": Spec("priority", True, _prio_order, _prio_level, _prio_victim, _prio_why,
                     level_prefix=1, orders=_prio_orders, none_below=_prio_none_below),
    "las": Spec("las", True, _las_order, _las_level, _las_victim, _las_why, level_prefix=1, orders=_las_orders,
                none_below=_las_none_below,
                running_levels=_band_levels(lambda cfg: cfg.las_thresholds_gpu_s, by_class=False)),
    "gandiva": Spec("gandiva", True, _gandiva_order, _gandiva_level, _gandiva_victim, _gandiva_why,
                    none_below=lambda jobs, c, bound: (1,) >= bound),   # every waiting job's level is (1,)
    "srtf-oracle": Spec("srtf-oracle", True, _srtf_order, _srtf_level, _srtf_victim, _srtf_why,
                        sim_only=True, level_prefix=1, none_below=_srtf_none_below),
    "gpuswap": Spec("gpuswap", True, _gs_order, _gs_level, _gs_victim, _gs_why, switch_cap=True,
                    benefit_ok=_gs_benefit, benefit_rank=_gs_benefit_rank, class_limits=True,
                    level_prefix=2, orders=_gs_orders, none_below=_gs_none_below,
                    running_levels=_band_levels(lambda cfg: cfg.gpuswap_bands_s, by_class=True, per_gpu=True),
                    reserves=True),
}
