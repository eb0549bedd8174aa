"""Request bodies and response records of the HTTP API (the CLI's `--json` prints these)."""
from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from fastapi import Path
from pydantic import BaseModel, BeforeValidator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from gpuswap.api.limits import check_command
from gpuswap.jobs import MAX_TIME_LIMIT_S, Priority
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.residue import kept_now
from gpuswap.node.store import Event, JobRecord
from gpuswap.policy.estimate import Estimate, remaining
from gpuswap.policy.model import Wait
from gpuswap.printable import printable


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
    # `--time`: run-seconds the user expects the job to need (gpuswap.jobs.parse_time_limit reads it)
    time_limit_s: Optional[float] = Field(default=None, gt=0, le=MAX_TIME_LIMIT_S, allow_inf_nan=False)

    @field_validator("argv", "cwd", "env", "name", "priority", "mem", mode="before")
    @classmethod
    def _exec_safe(cls, v: Any, info: ValidationInfo) -> Any:
        """Every string must survive SQLite (UTF-8) and exec (no NUL; no '=' in a variable's name),
        so a submit that cannot run is refused here, not failed later. The refusal names the
        argument or variable: the CLI sends the user's whole environment, where one variable
        holding a non-UTF-8 byte would otherwise block every submit with no clue which. Checked
        before the types (a non-string is left to them), as pydantic's own message for such a
        string in a length-limited field (cwd, name) names no culprit."""
        if isinstance(v, dict):
            for key, value in v.items():       # a JSON object's keys are strings
                name = repr(str(key)[:50])
                _exec_text(str(key), f"the name of environment variable {name}")
                if not key or "=" in str(key):
                    raise PydanticCustomError("env_name", f"environment variable name {name} is empty or contains '='")
                if isinstance(value, str):
                    _exec_text(value, f"environment variable {name}")
        elif isinstance(v, list):
            for i, arg in enumerate(v):
                if isinstance(arg, str):
                    _exec_text(arg, f"argv[{i}]")
        elif isinstance(v, str):
            _exec_text(v, "the working directory" if info.field_name == "cwd" else info.field_name or "value")
        return v

    @field_validator("argv")
    @classmethod
    def _command_named(cls, argv: list[str]) -> list[str]:
        # An empty program name would be accepted here and only fail at launch ("cannot start ''").
        if not argv[0].strip():
            raise ValueError("the command name (argv[0]) is empty")
        return argv

    @field_validator("name")
    @classmethod
    def _name_printable(cls, name: Optional[str]) -> Optional[str]:
        # A name is a label others see in listings: control characters in it can only be an attack
        # on their terminals (printable.py). A command may hold them; it is shown escaped.
        if name is not None and printable(name) != name:
            raise ValueError("name contains control characters (escape sequences, newlines, tabs, ...)")
        return name

    @model_validator(mode="after")
    def _within_size_limits(self) -> "SubmitRequest":
        check_command(self.argv, self.env)     # api/limits.py: bytes, not just counts
        return self


def _exec_text(text: str, what: str) -> None:
    # Messages made whole here, with no context for pydantic to format: a name may hold braces.
    if "\0" in text:
        raise PydanticCustomError("nul", f"{what} contains a NUL character")
    try:
        text.encode()
    except UnicodeEncodeError as e:    # a lone surrogate: what a byte that is not UTF-8 decodes to
        raise PydanticCustomError("not_text", f"{what} is not valid UTF-8 text: it holds the lone "
                                              f"surrogate {ascii(text[e.start])[1:-1]}") from None


class PauseRequest(BaseModel):
    to: str = "ram"


class ErrorDetail(BaseModel):
    """The body of every refusal (4xx): one sentence saying why, shown as-is by the CLI and dashboard."""
    detail: str


def errors(**codes: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the refusals an operation can answer, e.g. errors(e404="no such job")."""
    return {int(k.removeprefix("e")): {"model": ErrorDetail, "description": v} for k, v in codes.items()}


NO_JOB = "no such job, or another user's (its existence is not the caller's to know)"


def _digits(text: Any) -> Any:
    """A job id in a path is ASCII digits, as the CLI takes it: `int` alone would also read '1.0',
    ' 1' and '+1' as job 1."""
    if isinstance(text, str) and not (text.isascii() and text.isdigit()):
        raise ValueError(f"a job id is a whole number >= 1, not {text[:40]!r}")
    return text


JobId = Annotated[int, BeforeValidator(_digits), Path(ge=1, le=2**62, description="job id")]


def wait_fields(wait: Optional[Wait]) -> dict[str, Any]:
    """Why a job waits, as the policy's last round said (None for a job that is not waiting):
    `pending_reason` (the rule's code), `pending_reason_text` (a sentence with its numbers) and
    `pending_blockers` (each job holding a GPU it needs, the rule that keeps it, its numbers)."""
    if wait is None:
        return {"pending_reason": None, "pending_reason_text": "", "pending_blockers": []}
    return {"pending_reason": wait.code, "pending_reason_text": wait.text,
            "pending_numbers": dict(wait.numbers),
            "pending_blockers": [{"job_id": int(b.job_id), "gpus": list(b.gpus), "code": b.code, "text": b.text,
                                  "numbers": dict(b.numbers)} for b in wait.blockers]}


def residue_rows(j: JobRecord) -> list[dict[str, int]]:
    """What a job parked in RAM by its runtime still holds on each GPU (its CUDA context and what it
    did not attach, as NVML measured it after the park): [{"gpu": 0, "bytes": N}], else []."""
    return [{"gpu": g, "bytes": n} for g, n in sorted(kept_now(j).items())]


def job_record(j: JobRecord, now: float, events: Optional[list[Event]] = None,
               log_path: Optional[str] = None, *, gpus_simulated: bool, wait: Optional[Wait] = None) -> dict[str, Any]:
    """A job as the API shows it. `gpus_simulated`: the daemon's GPUs are simulated, so the GPU
    indices (and reasons naming them) are not real GPUs; every record says so. `wait`: why it
    waits (`Controller.wait_of`)."""
    out: dict[str, Any] = {
        "id": j.id,
        "name": j.name,
        "user": j.user,
        "state": j.state.value,
        "ended": j.state.terminal,
        "priority": Priority(j.priority).label,
        "preemptible": j.preemptible,
        "gpus": j.gpus,
        "assigned_gpus": j.assigned or j.home_gpus,
        "node": j.node,
        "gpus_simulated": gpus_simulated,
        "mem_bytes": j.mem_bytes,
        "device_bytes": j.device_bytes,
        "exit_code": j.exit_code,
        "signal": j.signal,
        "reason": j.reason,
        "parked": j.parked,
        "parked_bytes": j.parked_bytes,
        "residue": residue_rows(j),
        "ranks": j.ranks,
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
        "time_limit_s": j.time_limit_s,
        **estimate_fields(j),
        "argv": j.argv,
        "cwd": j.cwd,
        **wait_fields(wait),
    }
    if events is not None:
        out["events"] = [{"time": e.time, "state": e.state, "reason": e.reason, "kind": e.kind, "tier": e.tier,
                          "mechanism": e.mechanism, "initiator": e.initiator} for e in events]
    if log_path is not None:
        out["log"] = log_path
    return out


def estimate_fields(j: JobRecord) -> dict[str, Any]:
    """The job's runtime estimate, where it came from, and that in words ("4h from --time",
    "2.1h from 5 earlier runs of alice/train", "none")."""
    est = None if j.estimate_s is None else Estimate(j.estimate_s, j.estimate_from or "", j.estimate_runs)
    left = remaining(j.estimate_s, j.run_s)
    return {"estimate_s": j.estimate_s, "estimate_from": j.estimate_from, "estimate_runs": j.estimate_runs,
            "estimate": est.describe(j.user, j.name) if est else "none",
            "estimate_left_s": left, "estimate_outlived": j.estimate_s is not None and left is None}


def gpu_record(g: GpuInfo, used: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "index": g.index,
        "node": g.node,
        "name": g.name,
        "uuid": g.uuid,
        "simulated": g.simulated,
        "mem_total": g.mem_total,
        "mem_used": used,
        "jobs": jobs,
        "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in g.processes],
    }
