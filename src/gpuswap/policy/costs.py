"""Switch costs and the tier choice: where to park a victim (host RAM, disk, or not at all).

Kept apart from the policies so the engine, the daemon and the simulator use one arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from gpuswap.policy.capability import park_s, resume_s
from gpuswap.policy.model import JobView, PolicyConfig, Snapshot, SwitchCosts

UNLIMITED = float("inf")


def costs_on(snap: Snapshot, node: Optional[str]) -> SwitchCosts:
    """What moving a job's state costs on `node`: that node's own figures in a pool whose nodes
    were measured apart (`Snapshot.node_costs`), else the snapshot's one set. Every park, resume
    and spill of a job is priced with its own node's, so a node with a slow disk makes its jobs
    dearer to move to disk than the same jobs elsewhere."""
    by_node = snap.node_costs
    if not by_node or node is None:
        return snap.costs
    return by_node.get(node, snap.costs)


_GPU_NODES: list = [None, {}]    # memo: the GPU tuple last seen, GPU id -> its node


def costs_of(snap: Snapshot, job: JobView) -> SwitchCosts:
    """`costs_on` the node `job` is on: its GPUs' node while it holds GPUs, else the node its
    parked state is on (`JobView.node`)."""
    if not snap.node_costs:
        return snap.costs
    node = job.node
    if job.assigned:
        memo = _GPU_NODES
        if memo[0] is not snap.gpus:
            memo[0], memo[1] = snap.gpus, {g.id: g.node for g in snap.gpus}
        node = memo[1].get(job.assigned[0], node)
    return costs_on(snap, node)


def job_bytes(job: JobView) -> int:
    """Bytes a park moves: the per-GPU footprint times the job's GPUs."""
    return job.mem_bytes * max(job.gpus, 1)


def switch_s(job: JobView, tier: str, costs: SwitchCosts) -> float:
    """Seconds of GPU time lost to one park plus the matching resume (the round trip), at the
    job's width (policy/capability.py: ranks copy in parallel, plus the group's fixed cost)."""
    return park_resume_s(costs, job_bytes(job), tier, job.width)


_ROUND_TRIPS: list = [None, {}]   # memo: the SwitchCosts last seen, (bytes, width, tier) -> round trip
_ROUND_TRIPS_MAX = 4096           # distinct footprints kept per costs before their table starts afresh
# Every costs seen lately (a pool's nodes each have their own, and a round alternates between
# them): id -> (the costs, their table). The costs are kept in it, so an id is never reused while
# its entry lives; the daemon makes new costs only when a figure changes.
_TABLES: dict[int, tuple[SwitchCosts, dict]] = {}
_TABLES_MAX = 256


def _table(costs: SwitchCosts) -> dict:
    entry = _TABLES.get(id(costs))
    if entry is None or entry[0] is not costs:
        if len(_TABLES) >= _TABLES_MAX:
            _TABLES.clear()
        entry = _TABLES[id(costs)] = (costs, {})
    return entry[1]


def park_resume_s(costs: SwitchCosts, nbytes: int, tier: str, width: int) -> float:
    """`park_s + resume_s` of `nbytes` held by `width` ranks at `tier`: the same sum, kept per
    footprint. A round scores every victim on every node (and again after each pause there),
    and a victim's cost is worked out rank by rank (capability.py): most of a big round's cost
    went to recomputing the same few sums. (Keyed by the costs' identity: they are fixed for a
    run of the simulator and change rarely in the daemon; a pool's nodes' costs, which a round
    alternates between, each keep their own table.)"""
    memo = _ROUND_TRIPS
    if memo[0] is not costs:
        memo[0], memo[1] = costs, _table(costs)
    table = memo[1]
    key = (nbytes, width, tier)
    s = table.get(key)
    if s is None:
        if len(table) > _ROUND_TRIPS_MAX:
            table.clear()
        s = table[key] = park_s(costs, nbytes, tier, width) + resume_s(costs, nbytes, tier, width)
    return s


def ram_free_by_node(ram_budget: Mapping[str, int], ram_used: Mapping[str, int],
                     nodes: set[str]) -> dict[str, float]:
    """Room left in each node's host-RAM park budget. A node with no budget entry is unlimited."""
    return {n: (ram_budget[n] - ram_used.get(n, 0)) if n in ram_budget else UNLIMITED for n in nodes}


@dataclass(frozen=True, slots=True)
class ParkPlan:
    """How to park one victim: its tier, the RAM-parked jobs to spill to disk first, and the cost."""

    tier: str                              # "ram" | "disk"
    gpu_s: float                           # GPU-seconds lost: the victim's round trip + spill penalties
    spill: tuple[JobView, ...] = ()        # spilled before the victim is parked (it waits for the room)

    def per_gpu_s(self, job: JobView) -> float:
        """The plan's cost in seconds of the victim's own time (what victim orders and gates use)."""
        return self.gpu_s / max(job.gpus, 1)


def spill_penalty_gpu_s(job: JobView, costs: SwitchCosts) -> float:
    """What spilling a RAM-parked job costs in GPU time: its resume becomes a disk restart.
    The host-side write itself takes no GPU."""
    nbytes = job.parked_bytes or job_bytes(job)
    w = job.width
    return (resume_s(costs, nbytes, "disk", w) - resume_s(costs, nbytes, "ram", w)) * max(job.gpus, 1)


def park_plan(job: JobView, ram_room: float, spillable: Callable[[], Sequence[JobView]],
              costs: SwitchCosts, config: PolicyConfig) -> Optional[ParkPlan]:
    """The cheapest way to park `job` now, or None when it must not be paused.

    The one cost function behind every tier choice (issue 3): park to host RAM if the node's
    budget has room; or first spill RAM-parked jobs to disk (`spillable()`, least deserving first,
    asked only when the room is short) until it has, paying their slower disk restart later; or
    park straight to disk; whichever loses the fewest GPU-seconds (ties: fewer spills). A job
    without a runtime (empty `tiers`) or marked non-preemptible is never parked.
    """
    tiers = job.tiers
    if not job.preemptible or not tiers:
        return None
    gpus = job.gpus if job.gpus > 1 else 1
    nbytes = job.mem_bytes * gpus
    w = job.width
    best: Optional[tuple[float, int, str, tuple[JobView, ...]]] = None
    if "ram" in tiers:                      # the hot path: called for every victim scored
        ram_gpu_s = park_resume_s(costs, nbytes, "ram", w) * gpus
        if ram_room >= nbytes:
            best = (ram_gpu_s, 0, "ram", ())
        elif config.allow_disk:
            chosen, room, penalty = [], ram_room, 0.0
            for p in spillable():
                if room >= nbytes:
                    break
                chosen.append(p)
                room += p.parked_bytes or job_bytes(p)
                penalty += spill_penalty_gpu_s(p, costs)
            if room >= nbytes:
                best = (ram_gpu_s + penalty, len(chosen), "ram", tuple(chosen))
    if "disk" in tiers and config.allow_disk:
        disk = (park_resume_s(costs, nbytes, "disk", w) * gpus, 0, "disk", ())
        if best is None or disk[:2] < best[:2]:
            best = disk
    return ParkPlan(best[2], best[0], best[3]) if best is not None else None


def room_kept(job: JobView, ram_room: float) -> Optional[float]:
    """The RAM room above which `park_plan(job, room, ...)` gives the answer it gave at `ram_room`
    whatever the room and the spillables (None: only at that room and those spillables): any room
    for a job that cannot go to RAM, and any room that still holds it for one that went there
    without spilling."""
    if not job.preemptible or "ram" not in job.tiers:
        return -UNLIMITED
    nbytes = job.mem_bytes * (job.gpus if job.gpus > 1 else 1)
    return nbytes if ram_room >= nbytes else None


def disk_plan(job: JobView, costs: SwitchCosts, config: PolicyConfig) -> Optional[ParkPlan]:
    """`park_plan`'s disk choice alone (RAM ruled out: what the park would leave on the GPU is in
    the way, policy/residue.py), or None when the job cannot go to disk."""
    if not job.preemptible or "disk" not in job.tiers or not config.allow_disk:
        return None
    return ParkPlan("disk", switch_s(job, "disk", costs) * max(job.gpus, 1))


def choose_tier(job: JobView, node: str, ram_free: Mapping[str, float], costs: SwitchCosts,
                config: PolicyConfig) -> Optional[str]:
    """The tier `park_plan` would choose with nothing to spill (kept for callers outside the engine)."""
    plan = park_plan(job, ram_free.get(node, UNLIMITED), tuple, costs, config)
    return plan.tier if plan else None


def spill_order_ok(job: JobView, config: PolicyConfig) -> bool:
    """A RAM-parked job can be spilled to disk only if its runtime can write a checkpoint."""
    return job.parked == "ram" and "disk" in job.tiers and config.allow_disk
