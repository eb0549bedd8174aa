"""gpuswap's own policy: Tiresias-style LAS bands over service per GPU, under classes with limits
(policy/classes.py), ranked within a band by runtime estimates where there are any, and gated by
benefit versus switch cost (docs/policies.md). Its rules plug into the one engine like the others
(`specs.py` holds `Spec`, `Ctx` and the shared helpers; `policies.py` the table by name).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Hashable, Optional, Sequence

from gpuswap.policy import classes
from gpuswap.policy.classes import FLOOR, HEAD, class_of, level_class
from gpuswap.policy.fairshare import share_key
from gpuswap.policy.model import JobView
from gpuswap.policy.specs import (WAITING, Ctx, Key, Spec, band_levels, label, las_queue, service_s, since_start,
                                  starving)


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
    usage, now, factor, th, waiting = c.usage, c.now, c.config.las_starvation_factor, c.config.gpuswap_bands_s, WAITING
    lim = c.lim
    moved = lim.moved if lim.active else frozenset()   # gs_class written out: strict classes unless
    base, head, lifted = lim.base, lim.head, lim.lifted  # limits hold, and then only these move
    shares: dict[str, float] = {}           # user -> share_key at weight 1 (most jobs), looked up once
    known = c.known                         # keys the class limits worked out, at each job's own class
    out: list[Key] = []
    append = out.append
    for j in jobs:
        jid = j.id
        if moved and jid in moved:
            p = FLOOR if jid in lifted else base.get(jid, j.priority) + (HEAD if jid in head else 0)
        else:
            p = j.priority
        if known and p == j.priority:
            k = known.get(jid)
            if k is not None:
                append(k)
                continue
        s = j.attained_gpu_s
        if j.gpus > 1:
            s = s / j.gpus
        band = bisect_right(th, s)
        if band and j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            band = 0                        # starving: promoted
        w, user = j.weight, j.user
        if w == 1.0:
            share = shares.get(user)
            if share is None:
                share = shares[user] = usage.get(user, 0.0)
        else:
            share = usage.get(user, 0.0) / (w if w > 1e-9 else 1e-9)
        e = j.estimate_s
        if e is not None and e > j.run_s:   # a live estimate (expected_left, left_band written out)
            left = e - j.run_s
            append((-p, band, bisect_right(th, left), share, left, j.submit_time, jid))
        else:
            append((-p, band, band, share, s, j.submit_time, jid))
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
    now, factor, th, waiting = c.now, c.config.las_starvation_factor, c.config.gpuswap_bands_s, WAITING
    below = th[b_min - 1] if b_min > 0 else 0.0          # service per GPU under this: a lower band
    moved = c.lim.moved if c.lim.active else frozenset()    # only these are not at their own class
    for j in jobs:
        p = gs_class(j, c) if moved and j.id in moved else j.priority
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


def _gs_below(jobs: Sequence[JobView], c: Ctx, bound: Key) -> list[JobView]:
    """The jobs whose (class, band) is below bound's: a higher class, or bound's class and a lower
    band (`_gs_none_below`'s test, over every job; `gs_class` written out)."""
    top, b_min = -bound[0], bound[1]
    now, factor, th, waiting = c.now, c.config.las_starvation_factor, c.config.gpuswap_bands_s, WAITING
    below = th[b_min - 1] if b_min > 0 else 0.0          # service per GPU under this: a lower band
    lim = c.lim
    moved = lim.moved if lim.active else frozenset()    # gs_class written out, as in `_gs_orders`
    lifted, base, head = lim.lifted, lim.base, lim.head
    out: list[JobView] = []
    append = out.append
    for j in jobs:
        p = j.priority
        if moved and j.id in moved:
            p = FLOOR if j.id in lifted else base.get(j.id, p) + (HEAD if j.id in head else 0)
        if p > top:
            append(j)
        elif p < top or b_min <= 0:
            continue
        elif (j.attained_gpu_s / j.gpus if j.gpus > 1 else j.attained_gpu_s) < below:
            append(j)
        elif j.phase in waiting and j.run_s > 0 and now - j.phase_since >= factor * j.run_s:
            append(j)                       # starving: promoted to band 0
    return out


def _gs_victim(v: JobView, c: Ctx, cost: float) -> Key:
    """The job the order ranks last goes first: lowest class, highest band, most expected remaining
    time on the band scale (`left_band`: a job its estimate says is nearly done goes last); then the
    cheapest to park, the user most over their share, and the longest since its last switch (a job
    that has just been resumed is the most expensive to move again)."""
    band = gs_band(v, c)
    return (gs_class(v, c), -band, -left_band(v, band, c), round(cost, 1), -share_key(c.usage, v.user, v.weight),
            since_start(v), v.id)


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
        if gs_class(w, c) > gs_class(v, c):
            return True
    elif w.priority > v.priority:
        return True                 # a promise, like a class
    # `starving`, `may_take_by_promotion`, `starved` and `own_band` written out: a round asks this
    # of every victim of a level until one passes (~145 k times on the deep queue, 94% refused).
    cfg, run = c.config, w.run_s
    if w.phase in WAITING and run > 0 and c.now - w.phase_since >= cfg.las_starvation_factor * run:
        if not cfg.promotion_spares_starved:
            return True
        vrun = v.run_s
        if not (vrun > 0 and c.now - v.submit_time - vrun - v.switch_s >= cfg.las_starvation_factor * vrun):
            return True
        s = w.attained_gpu_s
        if w.gpus > 1:
            s = s / w.gpus
        if bisect_right(cfg.gpuswap_bands_s, s) >= gs_band(v, c):
            return False
    return expected_left(v) - expected_left(w) >= cfg.switch_benefit_factor * cost


def starved(v: JobView, c: Ctx) -> bool:
    """Whether `v` has waited, over its whole life, `las_starvation_factor` x its run time (the
    bound the promotion keeps): queued, parked or switching, everything but running."""
    return v.run_s > 0 and c.now - v.submit_time - v.run_s - v.switch_s >= c.config.las_starvation_factor * v.run_s


def may_take_by_promotion(w: JobView, v: JobView, c: Ctx) -> Optional[bool]:
    """For starving `w` (promoted to band 0): True when the promotion lets it pause `v` whatever
    the gain (a promise, or the promotion could never run it); False when only the promotion put
    it below `v` and `v` has starved as long itself; None: the benefit gate decides, as for any
    job of `w`'s service.

    A promoted job does not take the GPUs of a job that has itself waited the promotion's bound
    over its life (`starved`): that only moves the starving from one job to the other, and back
    once the other has waited in turn. On a deep queue (8,000 jobs of one Philly cluster on 48
    GPUs) nearly every job that had run once was soon starving, and starving jobs paused one
    another as soon as each one's protection ended: 5.0 preemptions per job, 84% of them by
    promotion (docs/simulator.md). Tiresias avoids it by resetting a promoted job's attained
    service, which a pure policy cannot do. (`promotion_spares_starved = False`: the old rule.)"""
    if not (c.config.promotion_spares_starved and starved(v, c)):
        return True
    if own_band(w, c) >= gs_band(v, c):
        return False
    return None


def own_band(w: JobView, c: Ctx) -> int:
    """`w`'s band by its service alone, promotion aside."""
    return bisect_right(c.config.gpuswap_bands_s, service_s(w))


def _gs_benefit_rank(w: JobView, c: Ctx) -> tuple[Hashable, float]:
    """Plans are kept per (group, rank) (preemption.py): within a group the gate is monotone in
    the rank, so one plan serves every job of a width at that rank. A lifted job's gate reads
    neither its estimate nor its starvation (`_gs_benefit`: a floor's promise), so all lifted jobs
    of a class rank alike, at -inf -- with a class under its floor, tens of them pause victims in
    one decision. A starving job gains what the gate gives any job of its expected remaining time,
    and besides what the promotion gives, which depends on its own band: a group of its own per band."""
    lim = c.lim
    if lim is not classes.NONE and lim.active:    # lifted or not, and the class it is treated at
        group = (gs_class(w, c), class_of(w, lim), w.id in lim.head)
        if w.id in lim.lifted:
            return group + (None,), float("-inf")
        return group + (own_band(w, c) if starving(w, c) else None,), expected_left(w)
    # Without limits (most calls), `starving`, `own_band` and `expected_left` written out: a full
    # cluster's round asks this of every waiting job it passes over (~1 M times on the deep queue).
    run = w.run_s
    if w.phase in WAITING and run > 0 and c.now - w.phase_since >= c.config.las_starvation_factor * run:
        s = w.attained_gpu_s
        if w.gpus > 1:
            s = s / w.gpus
        group = (w.priority, bisect_right(c.config.gpuswap_bands_s, s))
    else:
        s, group = None, (w.priority, None)
    e = w.estimate_s
    if e is not None:
        left = e - run
        if left > 0:
            return group, left
    if s is None:
        s = w.attained_gpu_s
        if w.gpus > 1:
            s = s / w.gpus
    return group, s


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


GPUSWAP = Spec("gpuswap", True, _gs_order, _gs_level, _gs_victim, _gs_why, switch_cap=True,
               benefit_ok=_gs_benefit, benefit_rank=_gs_benefit_rank, class_limits=True,
               level_prefix=2, orders=_gs_orders, none_below=_gs_none_below, below=_gs_below,
               running_levels=band_levels(lambda cfg: cfg.gpuswap_bands_s, by_class=True, per_gpu=True),
               reserves=True)
