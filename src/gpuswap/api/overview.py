"""`GET /v1/overview`: the whole picture in one record, for the dashboard and `gpuswap top`.

GPUs with memory and holders (each with its `node` in a pool, None on one machine), every live job (others' jobs show owner, state, priority and where
they are parked, but not their name or command, and are never actionable), the caller's recent
finished jobs, the host-RAM budget, bytes parked per tier and fair-share standing per user.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from gpuswap.api.auth import Caller
from gpuswap.api.views import estimate_fields, residue_rows, wait_fields
from gpuswap.jobs import JobState, Priority
from gpuswap.node.controller import Controller
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.residue import kept_now
from gpuswap.node.store import JobRecord, Store
from gpuswap.policy.model import Wait

RECENT_FINISHED = 20


def job_summary(j: JobRecord, who: Caller, now: float, wait: Wait | None) -> dict[str, Any]:
    mine = who.may_act_on(j.uid)
    return {
        "id": j.id, "name": j.name if mine else "", "user": j.user, "mine": mine,
        "state": j.state.value, "ended": j.state.terminal, "priority": Priority(j.priority).label, "preemptible": j.preemptible,
        "gpus": j.gpus, "assigned_gpus": j.assigned or j.home_gpus, "node": j.node, "tier": j.parked,
        "mechanism": j.mechanism if j.parked else None,
        "parked_bytes": j.parked_bytes, "device_bytes": j.device_bytes or j.mem_bytes,
        "residue": residue_rows(j),
        "held": j.hold, "stopped": j.stopped, "step": j.step if mine else None,
        "preemptions": j.preemptions, "time_in_state_s": max(0.0, now - j.state_since),
        "submit_time": j.submit_time, "exit_code": j.exit_code,
        "reason": j.reason if mine else "",
        # The runtime estimate and what is left of it (`ls`' LEFT), like the name and step only
        # for the caller's own jobs: an estimate comes from its owner's history.
        **(estimate_fields(j) if mine else {"estimate_s": None, "estimate_left_s": None, "estimate_outlived": False}),
        **wait_fields(wait),
    }


def gpu_used(mem_used: int | None, holders: list[JobRecord], kept: int = 0) -> int:
    """What NVML says (on simulated GPUs, the simulated device's process list). A simulated GPU no
    simulated CUDA process has touched: what its jobs report, parked jobs excluded, plus `kept`,
    what RAM-parked jobs keep there (`kept_on`)."""
    if mem_used is not None:
        return mem_used
    return sum((j.device_bytes or j.mem_bytes) for j in holders if j.holds_gpu) + kept


def kept_on(live: list[JobRecord]) -> dict[tuple[Optional[str], int], list[tuple[JobRecord, int]]]:
    """(node, GPU) -> (job, bytes) of the jobs parked in RAM by their runtime that keep memory on
    it; node None on a single daemon (a GPU is known by its node and index: node/pool.py)."""
    out: dict[tuple[Optional[str], int], list[tuple[JobRecord, int]]] = {}
    for j in live:
        for g, n in kept_now(j).items():
            out.setdefault((j.node, g), []).append((j, n))
    return out


def ram_by_node(controller: Controller, devices: list, live: list[JobRecord]) -> list[dict[str, Any]]:
    """A pool's nodes' host-RAM budgets for parked jobs and what is parked on each (one machine: none,
    its one budget is the daemon's)."""
    nodes = sorted({d.node for d in devices if d.node is not None})
    return [{"node": n, "budget": controller.pool.ram_budget(n, controller.config.ram_budget),
             "parked": sum(j.parked_bytes for j in live if j.parked == "ram" and j.node == n)} for n in nodes]


def ram_budget(controller: Controller, nodes: list[dict[str, Any]]) -> int:
    """The daemon's budget, or a pool's: its nodes' together."""
    return sum(n["budget"] for n in nodes) if nodes else controller.config.ram_budget


def holders_of(live: list[JobRecord]) -> dict[tuple[Optional[str], int], list[JobRecord]]:
    """(node, GPU) -> the jobs holding it."""
    out: dict[tuple[Optional[str], int], list[JobRecord]] = {}
    for j in live:
        for g in j.assigned:
            out.setdefault((j.node, g), []).append(j)
    return out


def build_overview(store: Store, controller: Controller, gpus: GpuInventory, who: Caller,
                   now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    devices = gpus.list()
    with store.at_one_instant():
        live = store.list(live_only=True)
        finished = store.recent_finished(None if who.admin else who.uid, RECENT_FINISHED)
    holders = holders_of(live)
    kept = kept_on(live)
    gpu_rows = [{
        "index": g.index, "node": g.node, "name": g.name, "simulated": g.simulated, "mem_total": g.mem_total,
        "mem_used": gpu_used(g.mem_used, holders.get((g.node, g.index), []),
                             sum(n for _, n in kept.get((g.node, g.index), []))),
        "jobs": [j.id for j in holders.get((g.node, g.index), [])],
        "residue": [{"job": j.id, "bytes": n} for j, n in kept.get((g.node, g.index), [])],
    } for g in devices]
    jobs = [job_summary(j, who, now, controller.wait_of(j)) for j in live]
    jobs += [job_summary(j, who, now, None) for j in finished]
    tiers = {"ram": 0, "disk": 0}
    for j in live:
        if j.parked in tiers:
            tiers[j.parked] += j.parked_bytes
    usage = dict(controller.usage)
    total = sum(usage.values())
    running: dict[str, int] = {}
    for j in live:
        if j.state in (JobState.RUNNING, JobState.RESUMING, JobState.PAUSING):
            running[j.user] = running.get(j.user, 0) + j.gpus
    fair = [{"user": u, "usage_gpu_s": usage.get(u, 0.0), "share": usage.get(u, 0.0) / total if total else 0.0,
             "gpus_now": running.get(u, 0)} for u in sorted(set(usage) | set(running))]
    fair.sort(key=lambda r: -r["usage_gpu_s"])
    ram_nodes = ram_by_node(controller, devices, live)
    return {
        "time": now, "simulated": gpus.simulated, "description": gpus.describe(),
        "policy": controller.config.policy,
        "caller": {"user": who.user, "uid": who.uid, "admin": who.admin},
        "gpus": gpu_rows, "jobs": jobs,
        "ram": {"budget": ram_budget(controller, ram_nodes), "parked": tiers["ram"], "nodes": ram_nodes},
        "parked_bytes": tiers, "fair_share": fair,
        "fair_share_half_life_s": controller.config.policy_config.fair_share_half_life_s,
    }
