"""What a job may tell its supervisor, typed and bounded: the one gate for job-supplied values.

Everything on the control socket comes from the job, and the supervisor (root) copies it into
`status.json`, which the daemon folds into SQLite. An unbounded integer there (SQLite INTEGER is
64-bit) once made every controller tick fail for every user. So each control message is validated
here where it is received (`parse`), and the runtime facts are validated again, with the same
bounds, where the daemon reads them back (status.py): a supervisor of an older version, still
running across an upgrade, may have written anything. A value that fails costs its job (ignored),
never the loop. The framing (one JSON object per line) is channel.py's.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, TypeAdapter,
                      ValidationError)

MAX_BYTES = 2**53          # 8 PiB: far above any node's GPU or host memory; exact in a float
MAX_STEP = 2**53
MAX_SECONDS = 1e9          # ~31 years
MAX_PID = 2**22            # the kernel's pid_max ceiling
MAX_TEXT = 500             # an error message is cut to this; a path longer than PATH_MAX is refused
MAX_NOTE = 2000            # what a restore says about the checkpoints it skipped (names and reasons)
MAX_PATH = 4096
MAX_LINE = 1 << 16         # no valid control message comes near this; a longer line is dropped unread


def _cut(v: Any) -> Any:
    return v[:MAX_TEXT] if isinstance(v, str) else v


def _cut_note(v: Any) -> Any:
    return v[:MAX_NOTE] if isinstance(v, str) else v


def _finite(v: Any) -> Any:
    # Strict: a JSON number only (no bool, no "1e308" string); inf/nan are refused by allow_inf_nan.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError("must be a number")
    try:
        return float(v)
    except OverflowError:   # an int beyond a float's range
        raise ValueError("out of range") from None


Bytes = Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)]
def _step(v: Any) -> Optional[int]:
    # The step is the user's own counter, informational only: a float step (3.0) is taken, and a
    # value that is no usable step is dropped rather than costing the message (a park report).
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not v.is_integer():
        return None
    return int(v) if -MAX_STEP <= v <= MAX_STEP else None


Step = Annotated[Optional[int], BeforeValidator(_step)]
Seconds = Annotated[float, BeforeValidator(_finite), Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Timestamp = Annotated[float, BeforeValidator(_finite), Field(ge=0, le=1e11, allow_inf_nan=False)]
Pid = Annotated[StrictInt, Field(ge=1, le=MAX_PID)]
Text = Annotated[str, BeforeValidator(_cut), Field(strict=True)]
Note = Annotated[str, BeforeValidator(_cut_note), Field(strict=True)]
FsPath = Annotated[str, Field(strict=True, max_length=MAX_PATH)]
TierName = Literal["ram", "disk"]
MAX_WORLD = 1024           # ranks of one job (runtime/ranks.py refuses more the same way)
MAX_EPOCH = 2**31          # pause attempts of one launch
Rank = Annotated[StrictInt, Field(ge=0, lt=MAX_WORLD)]
WorldSize = Annotated[StrictInt, Field(ge=1, le=MAX_WORLD)]
Epoch = Annotated[StrictInt, Field(ge=0, le=MAX_EPOCH)]
Tick = Annotated[StrictInt, Field(ge=0, le=MAX_STEP)]   # safepoint calls since attach
Seq = Annotated[StrictInt, Field(ge=1, le=MAX_STEP)]     # a checkpoint's number
# A part file of a multi-rank checkpoint: a bare name in the job's checkpoint directory, never a
# path (runtime/ckparts.py names them; rank 0 checks the same pattern again before it commits).
PartFile = Annotated[str, Field(strict=True, pattern=r"^ckpt-[0-9]{6,12}\.r[0-9]{1,4}\.pt$", max_length=40)]
Sha256 = Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{64}$")]
# Where a rank's cursor stands (runtime/rankcursor.py), said again in `hello` after a reconnect.
CursorPhase = Literal["running", "asked", "holding", "ready", "parked", "unparked", "written"]
# A rank as the coordinator lists it (runtime/agreement_state.py, RankState.state).
RankStateName = Literal["running", "holding", "ready", "parked", "unparked", "written", "done", "gone"]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    def wire(self) -> dict[str, Any]:
        """The JSON object sent on the channel (channel.encode): a field left None is left out."""
        return self.model_dump(exclude_none=True)


# -- supervisor -> runtime, single-rank (a multi-rank job's are runtime/agreement.py's) -------------
class PauseRequest(_Msg):
    op: Literal["pause"] = "pause"
    tier: TierName
    # ram only: what the host-RAM budget has left (the daemon's); a job holding more parks to disk
    # instead (or reports an error if it has no checkpoint directory)
    max_bytes: Optional[StrictInt] = None


class ResumeRequest(_Msg):
    """Resume a parked job, or withdraw a pause it has not reached a safepoint for."""
    op: Literal["resume"] = "resume"


Request = Union[PauseRequest, ResumeRequest]


# -- job -> supervisor: validated where received (`parse`) ----------------------------------------


class Hello(_Msg):
    """The runtime attached (and again on every reconnect): what it holds and what it restored."""
    op: Literal["hello"]
    pid: Optional[Pid] = None
    device_bytes: Bytes = 0
    parked: StrictBool = False
    restored_step: Step = None
    restored_bytes: Optional[Bytes] = None
    restore_s: Optional[Seconds] = None
    restore_note: Optional[Note] = None     # which checkpoint was used instead of a bad newer one, and why
    # A rank of a multi-rank job (world_size > 1 switches the launch to the coordinator):
    rank: Optional[Rank] = None
    world_size: Optional[WorldSize] = None
    local_rank: Optional[Rank] = None
    epoch: Optional[Epoch] = None           # the attempt its cursor is in, if any
    state: Optional[CursorPhase] = None
    ram_refusal: Optional[Text] = None      # why it cannot rebuild its process group in place
    restored_seq: Optional[Seq] = None      # the multi-rank checkpoint it restored: all ranks must agree


class Usage(_Msg):
    """Periodic, for accounting: device_bytes as measured at the last safepoint (never walked from
    another thread)."""
    op: Literal["usage"]
    device_bytes: Bytes = 0
    step: Step = None


class Paused(_Msg):
    op: Literal["paused"]
    epoch: Optional[Epoch] = None       # multi-rank: the attempt (also on resumed, error)
    tier: Optional[TierName] = None
    bytes: Bytes = 0
    seconds: Optional[Seconds] = None
    step: Step = None
    group_s: Optional[Seconds] = None   # multi-rank: this rank's process-group teardown (in `seconds`)


class Resumed(_Msg):
    op: Literal["resumed"]
    epoch: Optional[Epoch] = None
    bytes: Optional[Bytes] = None
    seconds: Optional[Seconds] = None
    group_s: Optional[Seconds] = None   # multi-rank: this rank's process-group rebuild (in `seconds`)


class Checkpointed(_Msg):
    """A disk park is written; the process then exits with gpuswap.jobs.REQUEUE_EXIT_CODE."""
    op: Literal["checkpointed"]
    path: Optional[FsPath] = None
    bytes: Bytes = 0
    seconds: Optional[Seconds] = None
    step: Step = None
    note: Optional[Text] = None     # why a RAM pause became this disk park (budget, CUDA graph)


class Error(_Msg):
    """A park (or a rank's step of one) failed; the job runs on."""
    op: Literal["error"]
    epoch: Optional[Epoch] = None
    message: Text = ""


class RestoreFailed(_Msg):
    """No usable checkpoint and no restart asked for (GPUSWAP_RESTART_ON_BAD_CHECKPOINT is not 1):
    sent on a one-off connection before attach returns; the job exits 1 right after (docs/runtime.md)."""
    op: Literal["restore_failed"]
    message: Note = "no usable checkpoint"


# The common-step agreement of a multi-rank job (runtime/agreement.py reads exactly these fields).
class Mark(_Msg):
    """The reader thread saw `pause`: the tick of its last safepoint."""
    op: Literal["mark"]
    epoch: Epoch
    seen: Tick


class Hold(_Msg):
    """The training thread stopped at a flagged safepoint before a target was known."""
    op: Literal["hold"]
    epoch: Epoch
    tick: Tick


class Ready(_Msg):
    op: Literal["ready"]
    epoch: Epoch
    tick: Tick
    step: Step = None


class Unparked(_Msg):
    op: Literal["unparked"]
    epoch: Epoch
    bytes: Optional[Bytes] = None
    seconds: Optional[Seconds] = None


class Part(_Msg):
    """A rank's part of a multi-rank checkpoint is durable (runtime/ckparts.py `write_part`). The
    rank is the connection's, not this message's: the coordinator sets it."""
    op: Literal["part"]
    epoch: Epoch
    file: PartFile
    bytes: Bytes
    sha256: Sha256
    seconds: Optional[Seconds] = None


class Committed(_Msg):
    """Rank 0 wrote the manifest: the checkpoint of every part is committed."""
    op: Literal["committed"]
    epoch: Epoch
    seq: Seq
    path: FsPath
    bytes: Bytes = 0
    step: Step = None                   # the user's step the checkpoint was taken at


class Done(_Msg):
    """The rank finished training (close or exit): the job is no longer pausable."""
    op: Literal["done"]
    step: Step = None


class Preempt(_Msg):
    """Under Slurm only: a rank got a preemption signal and asks the in-job coordinator for a disk
    pause of the whole job (runtime/slurmcoord.py). A supervisor ignores it."""
    op: Literal["preempt"]
    signal: Optional[Annotated[str, Field(strict=True, max_length=16)]] = None


Message = Union[Hello, Usage, Paused, Resumed, Checkpointed, Error, RestoreFailed, Mark, Hold, Ready, Unparked,
                Part, Committed, Done, Preempt]
OPS = frozenset({"hello", "usage", "paused", "resumed", "checkpointed", "error", "restore_failed",
                 "mark", "hold", "ready", "unparked", "part", "committed", "done", "preempt"})
RANK_OPS = frozenset({"usage", "paused", "resumed", "error", "mark", "hold", "ready", "unparked", "part",
                      "committed", "done"})
_MESSAGE: TypeAdapter[Message] = TypeAdapter(Annotated[Message, Field(discriminator="op")])


class BadMessage(ValueError):
    """A control line that is not a valid message (the runtime ships with the supervisor, so an
    unknown op is as invalid as any other)."""


def parse(line: bytes) -> Message:
    """One control line -> a validated message, or BadMessage saying why (one short line)."""
    try:
        return _MESSAGE.validate_json(line)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in err["loc"][1:] if p)
        raise BadMessage(f"{where + ': ' if where else ''}{err['msg']}"[:200]) from None
