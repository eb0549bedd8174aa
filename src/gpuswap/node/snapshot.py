"""Turn the daemon's records into the policy's Snapshot: the only place the two vocabularies meet."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

from gpuswap.jobs import JobState
from gpuswap.node import residue
from gpuswap.node.freezer import job_parkability, mechanism_for
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.store import JobRecord
from gpuswap.policy.model import GpuView, JobView, Phase, PolicyConfig, Snapshot, SwitchCosts

if TYPE_CHECKING:
    from gpuswap.node.pool import Layout

NODE = "local"


def job_view(j: JobRecord, transparent_ok: bool = False, migration: bool = False,
             layout: Optional["Layout"] = None, disk_nodes: tuple[str, ...] = (),
             allowed_nodes: tuple[str, ...] = ()) -> JobView:
    """The policy's view of a job. `transparent_ok`: this node can freeze jobs through the driver;
    `migration`: a driver-frozen job may be restored onto other GPUs. `layout`: a pool's GPU ids
    (node/pool.py), where the record's GPUs are its node's own indices; None: a single daemon.
    `disk_nodes`: in a pool, where a disk checkpoint of a parked job is reachable (Pool.disk_nodes);
    `allowed_nodes`: where a waiting job's working directory can be entered (node/workdirs.py)."""
    node = NODE if layout is None else j.node
    pool_id = (lambda g: g) if layout is None or j.node is None else (lambda g: layout.to_pool(j.node, g))
    pinned_home = j.parked == "ram" and not (j.mechanism == "transparent" and migration)
    # A cooperative park keeps what it could not free on the GPU; a driver checkpoint frees all.
    parking = j.state in (JobState.PAUSING, JobState.PAUSED)
    cooperative = (j.mechanism if parking else mechanism_for(j, transparent_ok)) == "cooperative"
    can = job_parkability(j, transparent_ok)
    return JobView(
        id=str(j.id),
        user=j.user,
        priority=j.priority,
        phase=Phase(j.state.value),
        gpus=j.gpus,
        mem_bytes=j.device_bytes or j.mem_bytes,
        submit_time=j.submit_time,
        phase_since=j.state_since,
        last_start=j.last_start,
        attained_gpu_s=j.attained_gpu_s,
        switch_s=j.switch_s,
        switches=j.preemptions,
        run_s=j.run_s,
        assigned=tuple(pool_id(g) for g in j.assigned),
        # A pause in flight counts where it is going, so two rounds cannot both fill the RAM budget.
        parked=(j.desired_tier or j.parked) if j.state == JobState.PAUSING else j.parked,
        parked_bytes=j.parked_bytes,
        preemptible=j.preemptible and not j.cancel_requested and not j.hold,
        tiers=can.tiers,
        why_not=can.why_not,
        width=j.width,
        holds_gpu_while_paused=j.state == JobState.PAUSED and j.holds_gpu,
        node=node,
        home_gpus=tuple(pool_id(g) for g in j.home_gpus) if pinned_home else (),
        residue_bytes=max(j.residue.values(), default=0) if cooperative else 0,
        estimate_s=j.estimate_s,      # made at submission by policy/estimate.py, as in the simulator
        disk_nodes=disk_nodes,
        allowed_nodes=allowed_nodes,
    )


def schedulable(j: JobRecord) -> bool:
    """Jobs the policy must see: everything live, except jobs a user holds paused off the GPU."""
    if j.state.terminal:
        return False
    if j.state == JobState.PAUSED and j.hold and not j.holds_gpu:
        return False
    if j.state == JobState.PENDING and j.cancel_requested:
        return False
    return True


def build(now: float, gpus: Iterable[GpuInfo], views: Iterable[JobView], config: PolicyConfig,
          costs: SwitchCosts, ram_budget: int | Mapping[str, int], usage: Mapping[str, float],
          kept: Mapping[int, int] | None = None,
          class_usage: Mapping[tuple[str, int], float] | None = None,
          node_costs: Mapping[str, SwitchCosts] | None = None) -> Snapshot:
    """`views`: job_view() of the schedulable jobs (the controller caches them per record version);
    `kept`: GPU -> what RAM-parked jobs outside the snapshot keep there (node/residue.py).
    `ram_budget`: host RAM parked jobs may hold, on every node or per node (a pool's, Pool.ram_budget).
    `node_costs`: a pool's nodes' own switch costs (node/nodebandwidths.py); None: `costs` everywhere."""
    kept = kept or {}
    gpus = tuple(gpus)
    nodes = sorted({g.node or NODE for g in gpus}) or [NODE]
    return Snapshot(
        now=now,
        gpus=tuple(GpuView(g.index, g.node or NODE, g.mem_total, residue_bytes=kept.get(g.index, 0)) for g in gpus),
        jobs=tuple(views),
        costs=costs,
        config=config,
        # Each node parks in its own host RAM: the budget is per node.
        ram_budget={n: ram_budget if isinstance(ram_budget, int) else ram_budget.get(n, 0) for n in nodes},
        usage=dict(usage),
        class_usage=dict(class_usage or {}),
        node_costs=dict(node_costs or {}),
    )


def pool_gpus(by_node: Mapping[str, list[GpuInfo]], single: bool) -> list[GpuInfo]:
    """A pool's GPUs as the policy numbers them (node/pool.py's Layout): a single daemon's as they
    are; a pool's with their id in the pool as `index` and their node named."""
    if single:
        return [g for gs in by_node.values() for g in gs]
    out, at = [], 0
    for name in sorted(by_node):
        for g in by_node[name]:
            out.append(replace(g, index=at + g.index, node=name))
        at += len(by_node[name])
    return out


def kept_in_pool(jobs: Iterable[JobRecord], in_snapshot: set[int], layout: "Layout") -> dict[int, int]:
    """residue.outside_snapshot for a pool: GPU id in the pool -> bytes kept by RAM-parked jobs
    the policy does not see (their records name their node's own GPU indices)."""
    out: dict[int, int] = {}
    for j in jobs:
        if j.id in in_snapshot or j.node is None or j.node not in layout.offsets:
            continue
        for g, n in residue.kept_now(j).items():
            pid = layout.to_pool(j.node, g)
            out[pid] = out.get(pid, 0) + n
    return out
