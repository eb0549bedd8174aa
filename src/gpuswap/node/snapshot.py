"""Turn the daemon's records into the policy's Snapshot: the only place the two vocabularies meet."""
from __future__ import annotations

from typing import Iterable, Mapping

from gpuswap.jobs import JobState
from gpuswap.node.freezer import job_parkability, mechanism_for
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.store import JobRecord
from gpuswap.policy.model import GpuView, JobView, Phase, PolicyConfig, Snapshot, SwitchCosts

NODE = "local"


def job_view(j: JobRecord, transparent_ok: bool = False, migration: bool = False) -> JobView:
    """The policy's view of a job. `transparent_ok`: this node can freeze jobs through the driver;
    `migration`: a driver-frozen job may be restored onto other GPUs."""
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
        assigned=tuple(j.assigned),
        # A pause in flight counts where it is going, so two rounds cannot both fill the RAM budget.
        parked=(j.desired_tier or j.parked) if j.state == JobState.PAUSING else j.parked,
        parked_bytes=j.parked_bytes,
        preemptible=j.preemptible and not j.cancel_requested and not j.hold,
        tiers=can.tiers,
        why_not=can.why_not,
        width=j.width,
        holds_gpu_while_paused=j.state == JobState.PAUSED and j.holds_gpu,
        node=NODE,
        home_gpus=tuple(j.home_gpus) if pinned_home else (),
        residue_bytes=max(j.residue.values(), default=0) if cooperative else 0,
        estimate_s=j.estimate_s,      # made at submission by policy/estimate.py, as in the simulator
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
          costs: SwitchCosts, ram_budget: int, usage: Mapping[str, float],
          kept: Mapping[int, int] | None = None,
          class_usage: Mapping[tuple[str, int], float] | None = None) -> Snapshot:
    """`views`: job_view() of the schedulable jobs (the controller caches them per record version);
    `kept`: GPU -> what RAM-parked jobs outside the snapshot keep there (node/residue.py)."""
    kept = kept or {}
    return Snapshot(
        now=now,
        gpus=tuple(GpuView(g.index, NODE, g.mem_total, residue_bytes=kept.get(g.index, 0)) for g in gpus),
        jobs=tuple(views),
        costs=costs,
        config=config,
        ram_budget={NODE: ram_budget},
        usage=dict(usage),
        class_usage=dict(class_usage or {}),
    )
