"""Small builders for hand-made snapshots (imported by the policy tests)."""
from __future__ import annotations

from gpuswap.jobs import Priority
from gpuswap.policy.model import GpuView, JobView, Phase, PolicyConfig, Snapshot, SwitchCosts

GiB = 1024**3


def gpus(n: int, nodes: int = 1) -> tuple[GpuView, ...]:
    return tuple(GpuView(k * n + i, f"n{k}") for k in range(nodes) for i in range(n))


def job(id: str, phase: Phase = Phase.PENDING, *, prio: Priority = Priority.NORMAL, user: str = "u",
        gpus: int = 1, mem_gib: float = 4, submit: float = 0.0, since: float = 0.0,
        last_start: float | None = None, attained: float = 0.0, run_s: float = 0.0,
        switch_s: float = 0.0, assigned: tuple[int, ...] = (), **kw) -> JobView:
    if phase == Phase.RUNNING and last_start is None:
        last_start = since
    return JobView(id=id, user=user, priority=int(prio), phase=phase, gpus=gpus,
                   mem_bytes=int(mem_gib * GiB), submit_time=submit, phase_since=since,
                   last_start=last_start, attained_gpu_s=attained, switch_s=switch_s, run_s=run_s,
                   assigned=assigned, **kw)


def snap(now: float, g, jobs, **kw) -> Snapshot:
    kw.setdefault("config", PolicyConfig())
    kw.setdefault("costs", SwitchCosts())
    return Snapshot(now=now, gpus=g, jobs=tuple(jobs), **kw)


def kinds(decisions) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.job_id) for d in decisions]
