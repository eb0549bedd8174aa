"""Request bodies and response records of the HTTP API (the CLI's `--json` prints these)."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, Field, field_validator

from gpuswap.jobs import Priority
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.store import Event, JobRecord


class SubmitRequest(BaseModel):
    argv: list[str] = Field(min_length=1, max_length=4096)
    cwd: str = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    name: Optional[str] = Field(default=None, max_length=200)
    priority: str = "normal"
    gpus: int = Field(default=1, ge=1, le=64)
    mem: Optional[Union[str, int]] = None
    preemptible: bool = True
    pause_mode: str = Field(default="auto", pattern="^(auto|cooperative|transparent)$")

    @field_validator("argv")
    @classmethod
    def _command_named(cls, argv: list[str]) -> list[str]:
        # An empty program name would be accepted here and only fail at launch ("cannot start ''").
        if not argv[0].strip():
            raise ValueError("the command name (argv[0]) is empty")
        return argv


class PauseRequest(BaseModel):
    to: str = "ram"


class ErrorDetail(BaseModel):
    """The body of every refusal (4xx): one sentence saying why, shown as-is by the CLI and dashboard."""
    detail: str


def errors(**codes: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the refusals an operation can answer, e.g. errors(e404="no such job")."""
    return {int(k.removeprefix("e")): {"model": ErrorDetail, "description": v} for k, v in codes.items()}


NO_JOB = "no such job, or another user's (its existence is not the caller's to know)"


def job_record(j: JobRecord, now: float, events: Optional[list[Event]] = None,
               log_path: Optional[str] = None, *, gpus_simulated: bool) -> dict[str, Any]:
    """A job as the API shows it. `gpus_simulated`: the daemon's GPUs are simulated, so the GPU
    indices (and reasons naming them) are not real GPUs; every record says so."""
    out: dict[str, Any] = {
        "id": j.id,
        "name": j.name,
        "user": j.user,
        "state": j.state.value,
        "priority": Priority(j.priority).label,
        "preemptible": j.preemptible,
        "gpus": j.gpus,
        "assigned_gpus": j.assigned or j.home_gpus,
        "gpus_simulated": gpus_simulated,
        "mem_bytes": j.mem_bytes,
        "device_bytes": j.device_bytes,
        "exit_code": j.exit_code,
        "signal": j.signal,
        "reason": j.reason,
        "parked": j.parked,
        "parked_bytes": j.parked_bytes,
        "held": j.hold,
        "stopped": j.stopped,
        "pause_mode": j.pause_mode,
        "runtime_attached": j.attached,
        "mechanism": j.mechanism,
        "transparent_refused": j.transparent_refused,
        "step": j.step,
        "preemptions": j.preemptions,
        "submit_time": j.submit_time,
        "state_since": j.state_since,
        "time_in_state_s": max(0.0, now - j.state_since),
        "end_time": j.end_time,
        "attained_gpu_s": j.attained_gpu_s,
        "run_s": j.run_s,
        "switch_s": j.switch_s,
        "argv": j.argv,
        "cwd": j.cwd,
    }
    if events is not None:
        out["events"] = [{"time": e.time, "state": e.state, "reason": e.reason} for e in events]
    if log_path is not None:
        out["log"] = log_path
    return out


def gpu_record(g: GpuInfo, used: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": g.index,
        "name": g.name,
        "uuid": g.uuid,
        "simulated": g.simulated,
        "mem_total": g.mem_total,
        "mem_used": used,
        "jobs": jobs,
        "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in g.processes],
    }
