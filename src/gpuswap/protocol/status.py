"""`status.json`: what the supervisor writes (`SupervisorStatus`) and what the daemon reads back
(`SupervisorReport`, with `RuntimeFacts` and `ExitFacts`), each field validated again.

What it holds under `runtime` came from the job, and a supervisor of an older version, still
running across an upgrade, may have written anything there. So every field is checked with the
bounds of the gate (bounds.py, as messages.py checks them) and one that is absent or fails is None (or its empty value): a
hostile or garbled field costs that field, never the record, the job or the controller's loop.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, WrapValidator

from gpuswap.protocol.bounds import (MAX_PID, MAX_TEXT, MAX_WORLD, Bytes, FsPath, Note, Pid, Rank, RankStateName,
                                       Seconds, Seq, Step, Text, Tick, TierName, Timestamp, WorldSize)


def _or_none(value: Any, handler: Any) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


# A field that is None when its value does not pass, instead of failing the whole record.
Lenient = WrapValidator(_or_none)
RunState = Literal["running", "paused", "checkpointed"]


class RankFact(BaseModel):
    """One rank as status.json lists it (the coordinator's record; `show` prints it)."""
    model_config = ConfigDict(extra="ignore", frozen=True)
    rank: Rank
    pid: Optional[Pid] = None
    connected: StrictBool = False
    state: RankStateName = "running"
    tick: Optional[Tick] = None
    step: Step = None
    device_bytes: Bytes = 0
    ram_refusal: Optional[Text] = None


class RuntimeFacts(BaseModel):
    """status.json's `runtime`: what the job's runtime said, as the supervisor folded it (single-
    rank: supervisor.py; multi-rank: runtime/ranktable.py, in the same vocabulary). Absent or invalid: None."""
    model_config = ConfigDict(extra="ignore", frozen=True)

    connected: Annotated[Optional[StrictBool], Lenient] = None     # a control connection is open
    attached: Annotated[Optional[StrictBool], Lenient] = None      # the runtime said hello (all ranks did)
    state: Annotated[Optional[RunState], Lenient] = None
    tier: Annotated[Optional[TierName], Lenient] = None            # where it is parked
    pid: Annotated[Optional[Pid], Lenient] = None
    device_bytes: Annotated[Optional[Bytes], Lenient] = None       # attached bytes at the last safepoint
    bytes: Annotated[Optional[Bytes], Lenient] = None              # bytes parked (RAM) or checkpointed (disk)
    step: Annotated[Step, Lenient] = None
    restored_step: Annotated[Step, Lenient] = None                 # the checkpoint restored at attach
    restored_bytes: Annotated[Optional[Bytes], Lenient] = None
    restore_s: Annotated[Optional[Seconds], Lenient] = None
    restore_note: Annotated[Optional[Note], Lenient] = None        # checkpoints skipped, or a restart from 0
    restore_failed: Annotated[Optional[Note], Lenient] = None      # no usable checkpoint: the job exits 1
    restored_seq: Annotated[Optional[Seq], Lenient] = None
    pause_s: Annotated[Optional[Seconds], Lenient] = None
    resume_s: Annotated[Optional[Seconds], Lenient] = None
    ckpt_path: Annotated[Optional[FsPath], Lenient] = None
    ckpt_note: Annotated[Optional[Text], Lenient] = None           # why a RAM pause became a disk park
    group_teardown_s: Annotated[Optional[Seconds], Lenient] = None  # multi-rank: the slowest rank's
    group_rebuild_s: Annotated[Optional[Seconds], Lenient] = None
    error: Annotated[Optional[Text], Lenient] = None               # the last request failed: why
    error_at: Annotated[Optional[Timestamp], Lenient] = None       # ... and when (the supervisor's clock)
    rejected: Annotated[Optional[Bytes], Lenient] = None           # invalid control messages ignored
    world_size: Annotated[Optional[WorldSize], Lenient] = None     # multi-rank only, from here down
    phase: Annotated[Optional[Text], Lenient] = None               # the coordinator's (runtime/agreement.py)
    not_pausable: Annotated[Optional[Text], Lenient] = None
    ranks: Annotated[Optional[Annotated[tuple[RankFact, ...], Field(max_length=MAX_WORLD)]], Lenient] = None

    @property
    def multi_rank(self) -> bool:
        return (self.world_size or 1) > 1


def runtime_facts(raw: Any) -> RuntimeFacts:
    """status.json's `runtime`, every field that is absent or invalid None."""
    return RuntimeFacts.model_validate(raw if isinstance(raw, dict) else {})


@dataclass(frozen=True)
class ExitFacts:
    """status.json's `exit` (the supervisor's own record of how the job's main process ended)."""
    code: Optional[int] = None
    signal: Optional[int] = None
    error: Optional[str] = None      # the job could not start, or its ranks' coordinator ended it
    time: Optional[float] = None     # when, by the supervisor's clock


def exit_facts(raw: Any) -> Optional[ExitFacts]:
    """status.json's `exit` (written by the supervisor itself), each field checked all the same;
    None while the job runs."""
    if not isinstance(raw, dict):
        return None
    code, sig, error, when = raw.get("code"), raw.get("signal"), raw.get("error"), raw.get("time")
    return ExitFacts(
        code=code if _small_int(code) else None,
        signal=sig if _small_int(sig) and 0 < sig < 128 else None,
        error=error[:MAX_TEXT] if isinstance(error, str) and error else None,
        time=when if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
    )


def rank_pids(raw: Any) -> list[tuple[int, Optional[int]]]:
    """status.json's `rank_pids` (the processes of a multi-rank job's ranks, by the kernel's
    SO_PEERCRED pid, with their start ticks): (pid, start ticks) for each valid entry."""
    out: list[tuple[int, Optional[int]]] = []
    for r in raw[:MAX_WORLD * 4] if isinstance(raw, list) else []:
        if not isinstance(r, dict) or pid_or_none(r.get("pid")) is None:
            continue
        out.append((r["pid"], start_ticks_or_none(r.get("start_ticks"))))
    return out


def pid_or_none(v: Any) -> Optional[int]:
    """A job pid read back from status.json, if it is one."""
    return v if _small_int(v) and 1 <= v <= MAX_PID else None


def start_ticks_or_none(v: Any) -> Optional[int]:
    """A process's start time (clock ticks since boot) read back from status.json, if it is one."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 else None


@dataclass(frozen=True)
class SupervisorReport:
    """status.json, validated: all the daemon reads of it (node/launcher.py's Observation)."""
    job_pid: Optional[int] = None            # the job's main process, its session's id
    job_start_ticks: Optional[int] = None    # ... and its start time, so a reused pid is never killed
    stopped: bool = False                    # the supervisor SIGSTOPped the job's process group
    exit: Optional[ExitFacts] = None
    runtime: RuntimeFacts = RuntimeFacts()
    rank_pids: tuple[tuple[int, Optional[int]], ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> "SupervisorReport":
        if not isinstance(raw, dict):
            return cls()
        return cls(job_pid=pid_or_none(raw.get("job_pid")),
                   job_start_ticks=start_ticks_or_none(raw.get("job_start_ticks")),
                   stopped=raw.get("stopped") is True, exit=exit_facts(raw.get("exit")),
                   runtime=runtime_facts(raw.get("runtime")), rank_pids=tuple(rank_pids(raw.get("rank_pids"))))


@dataclass
class SupervisorStatus:
    """status.json as the supervisor keeps it: its live record, written whole (atomically) on every
    change. `runtime` is the runtime's facts as they arrive (validated messages, or the multi-rank
    coordinator's own facts, which carry more than `RuntimeFacts` reads)."""
    job_id: int
    generation: int
    supervisor_pid: int
    started_at: float
    job_pid: Optional[int] = None
    job_start_ticks: Optional[int] = None        # written with job_pid
    runtime: dict[str, Any] = field(default_factory=lambda: {"connected": False, "attached": False, "state": None})
    stopped: bool = False
    exit: Optional[ExitFacts] = None
    rank_pids: Optional[list[dict[str, Any]]] = None   # a multi-rank job's: {rank, pid, start_ticks}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for late in ("job_start_ticks", "rank_pids"):   # absent until known, as always
            if out[late] is None:
                del out[late]
        return out


def _small_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -2**31 <= v < 2**31
