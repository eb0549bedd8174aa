"""Every message on the control channel, as one typed record per kind: the one definition that the
runtime builds and sends, and the supervisor and the in-job coordinator read.

Two directions, two kinds of trust:

- `Report`s go from a job's runtime to its supervisor (or to the in-job coordinator under Slurm):
  hello, usage, paused, resumed, checkpointed, error, restore_failed, and a rank's mark, hold,
  ready, unparked, part, committed, done, preempt. They are the job's word: they are read only
  through the gate, `messages.parse`, which validates every field against its bound (bounds.py)
  before a record exists.
- `Order`s go from the supervisor or the ranks' coordinator (runtime/agreement.py) to the runtime:
  pause, resume, and a rank's target, park, commit, exit, regroup, release. They come from root or
  from the job's own coordinator; the runtime reads them with `order` (a wrong type drops the
  message, never the reader thread), without pydantic, which it must not import at `attach`.

Wire: one JSON object per line (channel.py), a record's fields under their own names, a field
left None left out (except the few that hello, usage and done always carried, null included). The keys are the ones every release wrote, so a supervisor and a runtime of
neighbouring versions (a job outlives a daemon upgrade) still understand each other; an unknown
key is ignored by both readers.

Cheap to import: only the standard library (the annotations are strings, evaluated by the gate).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

from gpuswap.protocol import channel
from gpuswap.protocol.bounds import (AsideBytes, AsideFlag, AsideText, Bytes, CursorPhase, Epoch, Flag,  # noqa: F401
                                     FsPath, Note, PartFile, Pid, Rank, Seconds, Seq, Sha256, SignalName, Step,
                                     Text, Tick, TierName, WorldSize)

_record = dataclass(frozen=True, kw_only=True)


# -- runtime -> supervisor (or the in-job coordinator): read through messages.parse ----------------
@_record
class Hello:
    """The runtime attached (and again on every reconnect): what it holds and what it restored."""
    op: Literal["hello"] = "hello"
    pid: Optional[Pid] = None
    device_bytes: Bytes = 0
    restored_step: Step = None
    restored_bytes: Optional[Bytes] = None
    restore_s: Optional[Seconds] = None
    restore_note: Optional[Note] = None     # which checkpoint was used instead of a bad newer one, and why
    job_id: AsideText = None
    parked: Flag = False                    # still parked in RAM (a reconnect while parked)
    # A rank of a multi-rank job (world_size > 1 switches the launch to the coordinator):
    rank: Optional[Rank] = None
    world_size: Optional[WorldSize] = None
    local_rank: Optional[Rank] = None
    state: Optional[CursorPhase] = None     # where its cursor stands
    epoch: Optional[Epoch] = None           # the attempt its cursor is in, if any
    ram_refusal: Optional[Text] = None      # why it cannot rebuild its process group in place
    restored_seq: Optional[Seq] = None      # the multi-rank checkpoint it restored: all ranks must agree

    @property
    def _keep_none(self) -> tuple[str, ...]:
        return ("restored_step", "restored_bytes", "restore_s", "restore_note", "job_id") + (
            ("epoch", "ram_refusal", "restored_seq") if self.rank is not None else ())


@_record
class Usage:
    """Periodic, for accounting: device_bytes as measured at the last safepoint (never walked from
    another thread)."""
    op: Literal["usage"] = "usage"
    device_bytes: Bytes = 0
    step: Step = None
    parked: AsideFlag = None
    reserved_bytes: AsideBytes = None       # the CUDA caching allocator's, on a real GPU
    written: AsideBytes = None              # a rank's bytes written to checkpoint files so far: progress
    _keep_none = ("step",)


@_record
class Paused:
    op: Literal["paused"] = "paused"
    epoch: Optional[Epoch] = None       # multi-rank: the attempt (also on resumed, error)
    tier: Optional[TierName] = None
    bytes: Bytes = 0
    seconds: Optional[Seconds] = None
    step: Step = None
    group_s: Optional[Seconds] = None   # multi-rank: this rank's process-group teardown (in `seconds`)


@_record
class Resumed:
    op: Literal["resumed"] = "resumed"
    epoch: Optional[Epoch] = None
    bytes: Optional[Bytes] = None
    seconds: Optional[Seconds] = None
    group_s: Optional[Seconds] = None   # multi-rank: this rank's process-group rebuild (in `seconds`)


@_record
class Checkpointed:
    """A disk park is written; the process then exits with gpuswap.jobs.REQUEUE_EXIT_CODE."""
    op: Literal["checkpointed"] = "checkpointed"
    path: Optional[FsPath] = None
    bytes: Bytes = 0
    seconds: Optional[Seconds] = None
    step: Step = None
    note: Optional[Text] = None     # why a RAM pause became this disk park (budget, CUDA graph)


@_record
class Error:
    """A park (or a rank's step of one) failed; the job runs on."""
    op: Literal["error"] = "error"
    epoch: Optional[Epoch] = None
    message: Text = ""


@_record
class RestoreFailed:
    """No usable checkpoint and no restart asked for (GPUSWAP_RESTART_ON_BAD_CHECKPOINT is not 1):
    sent on a one-off connection before attach returns; the job exits 1 right after (docs/runtime.md)."""
    op: Literal["restore_failed"] = "restore_failed"
    message: Note = "no usable checkpoint"


# The common-step agreement of a multi-rank job (runtime/agreement.py reads exactly these fields).
@_record
class Mark:
    """The reader thread saw `pause`: the tick of its last safepoint."""
    op: Literal["mark"] = "mark"
    epoch: Epoch
    seen: Tick


@_record
class Hold:
    """The training thread stopped at a flagged safepoint before a target was known."""
    op: Literal["hold"] = "hold"
    epoch: Epoch
    tick: Tick


@_record
class Ready:
    op: Literal["ready"] = "ready"
    epoch: Epoch
    tick: Tick
    step: Step = None


@_record
class Unparked:
    op: Literal["unparked"] = "unparked"
    epoch: Epoch
    bytes: Optional[Bytes] = None
    seconds: Optional[Seconds] = None


@_record
class Part:
    """A rank's part of a multi-rank checkpoint is durable (runtime/ckparts.py `write_part`). The
    rank is the connection's, not this message's: the coordinator sets it."""
    op: Literal["part"] = "part"
    epoch: Epoch
    file: PartFile
    bytes: Bytes
    sha256: Sha256
    seconds: Optional[Seconds] = None


@_record
class Committed:
    """Rank 0 wrote the manifest: the checkpoint of every part is committed."""
    op: Literal["committed"] = "committed"
    epoch: Epoch
    seq: Seq
    path: FsPath
    bytes: Bytes = 0
    step: Step = None                   # the user's step the checkpoint was taken at


@_record
class Done:
    """The rank finished training (close or exit): the job is no longer pausable."""
    op: Literal["done"] = "done"
    step: Step = None
    _keep_none = ("step",)


@_record
class Preempt:
    """Under Slurm only: a rank got a preemption signal and asks the in-job coordinator for a disk
    pause of the whole job (runtime/slurmcoord.py). A supervisor ignores it."""
    op: Literal["preempt"] = "preempt"
    signal: Optional[SignalName] = None


Report = Union[Hello, Usage, Paused, Resumed, Checkpointed, Error, RestoreFailed, Mark, Hold, Ready, Unparked,
               Part, Committed, Done, Preempt]
REPORTS: dict[str, type] = {c.op: c for c in Report.__args__}   # type: ignore[attr-defined]


# -- supervisor or coordinator -> runtime: read with `order` ----------------------------------------
@_record
class Pause:
    """Park at the next safepoint (single-rank), or start an agreement on a common step (a rank:
    then `epoch` numbers the attempt)."""
    op: Literal["pause"] = "pause"
    epoch: Optional[int] = None
    tier: str = "ram"
    # single-rank, ram only: what the host-RAM budget has left (the daemon's); a job holding more
    # parks to disk instead (or reports an error if it has no checkpoint directory)
    max_bytes: Optional[int] = None


@_record
class Resume:
    """Resume a parked job, or withdraw a pause it has not reached a safepoint for."""
    op: Literal["resume"] = "resume"
    epoch: Optional[int] = None


@_record
class Target:
    """Every rank is bounded: stop at tick `tick`, none past it."""
    op: Literal["target"] = "target"
    epoch: int
    tick: int


@_record
class Park:
    """Every rank is ready at the target: park to RAM, or write this rank's part (disk)."""
    op: Literal["park"] = "park"
    epoch: int
    tier: str


@_record
class PartRef:
    """One rank's durable part, as rank 0 lists it in the manifest (ckparts.write_manifest checks
    each again)."""
    file: str
    bytes: int
    sha256: str
    seconds: Optional[float] = None
    rank: int


@_record
class Commit:
    """To rank 0: every part is durable, write the manifest."""
    op: Literal["commit"] = "commit"
    epoch: int
    tick: Optional[int] = None
    parts: tuple[PartRef, ...] = ()


@_record
class Exit:
    """The checkpoint is committed: exit with the requeue code."""
    op: Literal["exit"] = "exit"
    epoch: int


@_record
class Regroup:
    """Every rank has its memory back: make the process group again (`rebuild`), then train on."""
    op: Literal["regroup"] = "regroup"
    epoch: int
    rebuild: bool = True


@_record
class Release:
    """An unpark (or a spill) failed elsewhere: free the memory again and stay parked."""
    op: Literal["release"] = "release"
    epoch: int


Order = Union[Pause, Resume, Target, Park, Commit, Exit, Regroup, Release]
ORDERS: dict[str, type] = {c.op: c for c in Order.__args__}   # type: ignore[attr-defined]
Record = Union[Report, Order]


# -- wire -----------------------------------------------------------------------------------------
def wire(record: Any) -> dict[str, Any]:
    """The JSON object of a record: its fields by name, those left None left out (but those a
    kind has always written, as null: `_keep_none`, for readers that index them)."""
    out: dict[str, Any] = {}
    keep = getattr(record, "_keep_none", ())
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.name not in keep:
            continue
        if isinstance(value, tuple):
            value = [wire(v) for v in value]
        out[f.name] = value
    return out


def encode(record: Any) -> bytes:
    """One line of the channel."""
    return channel.encode(wire(record))


# What each field of an order must be (the runtime's reader checks these; bool is no int here).
_ORDER_FIELDS: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "tier": (str,), "max_bytes": (int,), "tick": (int,), "rebuild": (bool,),
    "file": (str,), "bytes": (int,), "sha256": (str,), "seconds": (int, float), "rank": (int,)}


def _fields_of(cls: type, raw: dict[str, Any]) -> Any:
    args: dict[str, Any] = {}
    for f in fields(cls):
        value = raw.get(f.name)
        if f.name == "op" or value is None:
            continue                        # absent or null: the default (a required field: TypeError)
        if f.name == "parts":
            if not isinstance(value, list):
                raise ValueError("parts")
            value = tuple(_fields_of(PartRef, p) if isinstance(p, dict) else _bad("parts") for p in value)
        elif not isinstance(value, _ORDER_FIELDS[f.name]) or (isinstance(value, bool)
                                                               and bool not in _ORDER_FIELDS[f.name]):
            raise ValueError(f.name)
        args[f.name] = value
    return cls(**args)


def _bad(name: str) -> Any:
    raise ValueError(name)


def order(raw: Any) -> Optional[Order]:
    """A message from the supervisor or the coordinator (one JSON object) as its record; None for
    an op this runtime does not know or a field of the wrong type (the message is dropped)."""
    cls = ORDERS.get(raw.get("op")) if isinstance(raw, dict) else None
    if cls is None:
        return None
    try:
        return _fields_of(cls, raw)
    except (TypeError, ValueError):
        return None
