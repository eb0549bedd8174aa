"""Choosing whom to pause for a waiting job: eligible victims, their park plans, the best plan.

Rules kept here once for every policy: a victim is RUNNING, preemptible, has a runtime and is past
its protection after its last start or resume (`protected_s`: a multiple of what a switch of it
costs, between a floor and a cap); a waiting job may pause it only if its level is strictly
lower; the policy's victim order holds across the whole cluster; a victim is parked by the
cheapest plan (`costs.park_plan`) and, for policies that ask, only within the switch-time cap and
when the benefit beats the cost.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from operator import itemgetter
from typing import Optional

from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.costs import (ParkPlan, costs_of, costs_on, job_bytes, park_plan, room_kept, spill_penalty_gpu_s,
                                  switch_s)
from gpuswap.policy.model import JobView, Phase, Snapshot
from gpuswap.policy.residue import after_park
from gpuswap.policy.specs import Ctx, Spec

Chosen = list[tuple[JobView, ParkPlan]]


@dataclass(slots=True)
class Victim:
    job: JobView
    node: str
    level: tuple
    plan: Optional[ParkPlan] = None   # from scoring, valid while the node's RAM version is `seen`
    seen: int = -1
    key: Optional[tuple] = None       # its victim key when last scored (None: no plan then)


def under_switch_cap(v: JobView, cost: float, snap: Snapshot) -> bool:
    """Anti-thrashing: a job whose switch time would exceed the configured share of its life is left alone."""
    life = max(snap.now - v.submit_time, 0.0) + cost
    return life <= 0 or (v.switch_s + cost) / life <= snap.config.max_switch_fraction


def round_trip_s(v: JobView, snap: Snapshot) -> tuple[float, str]:
    """What one switch (park + resume) of `v` costs, and where the figure comes from: its own
    measured mean once it has been preempted ("measured"), else the cost model at the tier it
    would be parked to -- host RAM when its runtime can, else disk ("ram" | "disk"). The RAM
    budget's state is left out on purpose: a job's protection should not come and go with it."""
    if v.switches > 0 and v.switch_s > 0:
        return v.switch_s / v.switches, "measured"
    tier = "ram" if "ram" in v.tiers else "disk"
    return switch_s(v, tier, costs_of(snap, v)), tier


def protected_s(v: JobView, snap: Snapshot) -> float:
    """How long after its last start or resume `v` may not be paused: protect_multiple x its
    round trip, clamped to [min_runtime_s, protect_cap_s] (the floor wins over a lower cap).
    A cheap-to-park job is protected only briefly, so an urgent job gets it in seconds; an
    expensive one long enough that its switches stay a small share of its time."""
    c = snap.config
    floor = c.min_runtime_s
    if c.protect_multiple <= 0 or c.protect_cap_s <= floor:
        return floor
    return max(floor, min(c.protect_multiple * round_trip_s(v, snap)[0], c.protect_cap_s))


def _anchor(v: JobView) -> float:
    return v.phase_since if v.last_start is None else v.last_start


def _s(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def protection_text(v: JobView, left: float, snap: Snapshot) -> tuple[str, dict[str, float]]:
    """The reason a waiting job reads for a protected holder: the seconds left, the protection and
    why it is that long (the multiple of which switch cost, or the floor, or the cap)."""
    c = snap.config
    p = protected_s(v, snap)
    rt, source = round_trip_s(v, snap)
    if source == "measured":
        what = f"its measured {rt:.1f} s park + resume (mean of {v.switches} preemption{'s' * (v.switches != 1)})"
    else:
        what = f"its {rt:.1f} s park + resume {'in RAM' if source == 'ram' else 'to disk'}"
    numbers = {"seconds_left": left, "protected_s": p, "round_trip_s": rt, "multiple": c.protect_multiple,
               "min_runtime_s": c.min_runtime_s, "cap_s": c.protect_cap_s}
    scaled = c.protect_multiple * rt
    if c.protect_multiple <= 0:
        why = f"the {_s(p)} s minimum runtime after a start or resume"
    elif p == c.min_runtime_s:
        why = (f"the {_s(p)} s minimum runtime after a start or resume ({c.protect_multiple:g} x {what} "
               + ("is less)" if scaled <= p else f"would be {_s(scaled)} s, over the {_s(c.protect_cap_s)} s cap)"))
    elif scaled > p:
        why = f"{c.protect_multiple:g} x {what}, capped at {_s(p)} s"
    else:
        why = f"{c.protect_multiple:g} x {what} = {_s(p)} s after a start or resume"
    return f"protected for {math.ceil(left)} s more: {why}", numbers


def protection(v: JobView, snap: Snapshot) -> Optional[tuple[str, str, dict[str, float]]]:
    """Why a RUNNING job may not be paused for anyone: (code, text, numbers), or None when it may.
    The rules `eligible` applies, one job at a time (tested to agree), for explanations."""
    if not v.preemptible:
        return "NoPreempt", "not preemptible", {}
    if not v.tiers:
        return "NotParkable", f"cannot be parked: {v.why_not or 'no gpuswap runtime attached and no driver freeze'}", {}
    left = _anchor(v) - (snap.now - protected_s(v, snap))     # the same arithmetic as `eligible`
    if left > 0:
        text, numbers = protection_text(v, left, snap)
        return "MinRuntime", text, numbers
    return None


def may_spill_for(w: JobView, lw: Optional[tuple], p: JobView, snap: Snapshot, spec: Spec, ctx: Ctx) -> bool:
    """Whether waiting job `w` (level `lw`) may have RAM-parked `p` spilled to disk to clear the
    residue `p` keeps on a GPU `w` needs: the rules that would let `w` pause `p` were it running
    (preemptible, a disk tier, a strictly lower level, the switch cap and benefit gates), at the
    spill's cost (its resume becomes a disk restart)."""
    if lw is None or p.phase is not Phase.PAUSED or p.parked != "ram" or not p.preemptible:
        return False
    if "disk" not in p.tiers or not snap.config.allow_disk or p.holds_gpu_while_paused:
        return False
    if not lw < spec.level(p, ctx):
        return False
    cost = spill_penalty_gpu_s(p, costs_of(snap, p)) / max(p.gpus, 1)
    if spec.switch_cap and not under_switch_cap(p, cost, snap):
        return False
    return spec.benefit_ok is None or spec.benefit_ok(w, p, ctx, cost)


def switch_cap_numbers(v: JobView, cost: float, snap: Snapshot) -> dict[str, float]:
    """The figures behind `under_switch_cap`: this switch's cost, the switch time and life it would
    make, the cap, and how many more seconds of life would bring the job under it."""
    cap = snap.config.max_switch_fraction
    age = max(snap.now - v.submit_time, 0.0)
    after = (v.switch_s + cost) / cap - cost if cap > 0 else float("inf")
    return {"switch_s": cost, "switched_s": v.switch_s + cost, "life_s": age + cost, "cap": cap,
            "fraction": (v.switch_s + cost) / (age + cost) if age + cost > 0 else 0.0,
            "allowed_in_s": max(after - age, 0.0)}


def eligible(snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState) -> tuple[list[JobView], list[tuple]]:
    """Running jobs that may be paused at all (runtime attached, preemptible, past their
    protection), with their levels.

    Comprehensions rather than one loop: this runs on most calls of a busy cluster, over every
    running job, and is the simulator's hottest path. A job's switch cost is worked out only
    between the floor and the longest protection (`settled`); most running jobs are past it.
    """
    now, c = snap.now, snap.config
    floor_after = now - c.min_runtime_s
    settled = now - max(c.min_runtime_s, c.protect_cap_s if c.protect_multiple > 0 else 0.0)
    running = cl.running
    at = [i for i, v in enumerate(running) if v.preemptible and v.tiers
          and ((t := (v.phase_since if v.last_start is None else v.last_start)) <= settled
               or (t <= floor_after and t <= now - protected_s(v, snap)))]
    if not at:
        return [], []
    levels = running_levels(spec, ctx, cl)
    return [running[i] for i in at], [levels[i] for i in at]


def running_levels(spec: Spec, ctx: Ctx, cl: ClusterState) -> list[tuple]:
    """The preemption levels of `cl.running`, in its order, worked out once a round and kept on
    `cl` (one spec and context a round): the eligible victims and the reservations both read them,
    and on the Philly trace working them out twice was ~4% of `gpuswap`'s time."""
    if cl.running_levels is None:
        running = cl.running
        cl.running_levels = (spec.running_levels(running, ctx) if spec.running_levels
                             else [spec.level(v, ctx) for v in running])
    return cl.running_levels


def pairs_by_node(jobs: list[JobView], levels: list[tuple], cl: ClusterState) -> dict[str, list[tuple[JobView, tuple]]]:
    """The eligible jobs and their levels, per node (pairs: Victim records are made per node, on need)."""
    out: dict[str, list[tuple[JobView, tuple]]] = defaultdict(list)
    node_of, job_node = cl.node_of, cl.job_node
    for v, lv in zip(jobs, levels):
        node = node_of.get(v.assigned[0]) if v.assigned else None
        if node is None:
            node = job_node(v)
        out[node].append((v, lv))
    return out


def scored(victims: list[Victim], cl: ClusterState, snap: Snapshot, spec: Spec, ctx: Ctx,
           memo: Optional[dict[tuple[str, str], tuple]] = None) -> list[tuple[tuple, Victim]]:
    """Victims in the policy's victim order, each keyed with the cost of its cheapest park plan
    (kept on the victim: `plan_on` reuses it while its node's RAM room is unchanged).

    `memo` (one round's: (job, node) -> (RAM version, room kept, plan, key)) answers a victim
    scored before when its plan still holds: at the same RAM version of its node (the plan reads
    only the node's RAM room and spillables, and `ClusterState.ram_version` moves with both), or
    while the room stays above what `costs.room_kept` says; the key reads the job, the round's
    context and the cost. A round scores a node's victims again after each pause there, and the
    victims of a level again in `Preemption`'s groups."""
    out = []
    ram_version, ram_free = cl.ram_version, cl.ram_free
    for c in victims:
        node = c.node
        seen = ram_version[node]
        hit = memo.get((c.job.id, node)) if memo is not None else None
        if hit is not None and (hit[0] == seen or (hit[1] is not None and ram_free[node] >= hit[1])):
            c.plan, c.key = hit[2], hit[3]
        else:
            room = ram_free[node]
            c.plan = park_plan(c.job, room, lambda n=node: cl.spillable_on(n), costs_on(snap, node), snap.config)
            c.key = None if c.plan is None else spec.victim(c.job, ctx, c.plan.per_gpu_s(c.job))
            if memo is not None:
                memo[c.job.id, node] = (seen, room_kept(c.job, room), c.plan, c.key)
        c.seen = seen
        if c.key is not None:
            out.append((c.key, c))
    out.sort(key=itemgetter(0))
    return out


def plan_on(w: JobView, lw: tuple, node: str, ranked: list[tuple[tuple, Victim]], missing: int,
            cl: ClusterState, snap: Snapshot, spec: Spec,
            ctx: Ctx) -> Optional[tuple[Chosen, float, tuple]]:
    """Victims on `node` (in victim order) that free `missing` GPUs for `w`, each with its park plan,
    the GPU-seconds the switches cost, and the victim key of the last (least preferred) one.

    Plans on different nodes are compared by that key first, so the victim order holds across the
    cluster, not only within a node: ranking by cost alone paused jobs the order ranks high (a low
    LAS band) only for them to preempt a higher band in turn -- a cascade that made 8x more
    preemptions on a Philly window.
    """
    ram_left = room = cl.ram_free[node]
    version = cl.ram_version[node]
    spilled: set[str] = set()                         # spill candidates this plan already uses
    chosen: Chosen = []
    total = 0.0
    worst: tuple = ()
    for vkey, c in ranked:
        if missing <= 0:
            break
        if not lw < c.level:
            continue
        v = c.job
        if c.seen == version and ((not spilled and ram_left == room)
                                  or ((kept := room_kept(v, room)) is not None and ram_left >= kept)):
            plan = c.plan                   # as scored (nothing on this node has changed since), or
        else:                               # the room this plan leaves still holds it: the same answer
            plan = park_plan(v, ram_left, lambda: [p for p in cl.spillable_on(node) if p.id not in spilled],
                             costs_on(snap, node), snap.config)
        if plan is None:
            continue
        if cl.residue or v.residue_bytes > 0:   # would its RAM park leave too little room for w?
            plan = after_park(w, v, plan, cl, snap)
            if plan is None:
                continue
        cost = plan.per_gpu_s(v)
        if spec.switch_cap and not under_switch_cap(v, cost, snap):
            continue
        if spec.benefit_ok is not None and not spec.benefit_ok(w, v, ctx, cost):
            continue
        if plan.tier == "ram":
            ram_left += sum(p.parked_bytes or job_bytes(p) for p in plan.spill) - job_bytes(v)
            spilled |= {p.id for p in plan.spill}
        chosen.append((v, plan))
        total += plan.gpu_s
        missing -= len(v.assigned)
        worst = vkey
    return (chosen, total, worst) if missing <= 0 and chosen else None
