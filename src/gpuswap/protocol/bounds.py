"""The bounds every value from a job must keep, as `Annotated` types, importable without pydantic.

Why here and why this way: the message records (records.py) are built and sent by the runtime
inside the user's job, which imports them at `attach` and must stay free of pydantic there; the
gate (messages.py) and status.json's reader (status.py) validate the same fields with pydantic.
So each bound is written once, as `Annotated` metadata (`Bound`) that pydantic understands through
its documented `__get_pydantic_core_schema__` hook: the schema is built only when a gate builds
its validator, and importing this module costs nothing.

An unbounded integer in status.json (SQLite INTEGER is 64-bit) once made every controller tick
fail for every user: hence a range on every number, a length on every text.
"""
from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional

MAX_BYTES = 2**53          # 8 PiB: far above any node's GPU or host memory; exact in a float
MAX_STEP = 2**53
MAX_SECONDS = 1e9          # ~31 years
MAX_PID = 2**22            # the kernel's pid_max ceiling
MAX_TEXT = 500             # an error message is cut to this; a path longer than PATH_MAX is refused
MAX_NOTE = 2000            # what a restore says about the checkpoints it skipped (names and reasons)
MAX_PATH = 4096
MAX_LINE = 1 << 16         # no valid control message comes near this; a longer line is dropped unread
MAX_WORLD = 1024           # ranks of one job (runtime/ranks.py refuses more the same way)
MAX_EPOCH = 2**31          # pause attempts of one launch


class Bound:
    """`Annotated` metadata: a strict JSON value of `kind` ("int", "float", "str", "bool") with
    pydantic-core's constraints (ge, le, lt, max_length, pattern, allow_inf_nan), after `before`
    (a plain function run on the raw value first, e.g. to cut a text); `nullable`: None passes.
    `lenient`: a value that fails is `default` instead of failing the message (fields the
    supervisor never reads)."""

    __slots__ = ("kind", "before", "nullable", "lenient", "default", "constraints")

    def __init__(self, kind: str, *, before: Optional[Callable[[Any], Any]] = None, nullable: bool = False,
                 lenient: bool = False, default: Any = None, **constraints: Any) -> None:
        self.kind, self.before, self.nullable = kind, before, nullable
        self.lenient, self.default, self.constraints = lenient, default, constraints

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema as cs

        make = {"int": cs.int_schema, "float": cs.float_schema, "str": cs.str_schema, "bool": cs.bool_schema}
        strict = {} if self.kind == "float" else {"strict": True}   # a float is checked by `before`
        schema = make[self.kind](**strict, **self.constraints)
        if self.nullable:
            schema = cs.nullable_schema(schema)
        if self.before is not None:
            schema = cs.no_info_before_validator_function(self.before, schema)
        if self.lenient:
            default = self.default

            def or_default(value: Any, inner: Any) -> Any:
                try:
                    return inner(value)
                except ValueError:     # pydantic_core.ValidationError is a ValueError
                    return default
            schema = cs.no_info_wrap_validator_function(or_default, schema)
        return schema


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


def _step(v: Any) -> Optional[int]:
    # The step is the user's own counter, informational only: a float step (3.0) is taken, and a
    # value that is no usable step is dropped rather than costing the message (a park report).
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not v.is_integer():
        return None
    return int(v) if -MAX_STEP <= v <= MAX_STEP else None


Bytes = Annotated[int, Bound("int", ge=0, le=MAX_BYTES)]
Step = Annotated[Optional[int], Bound("int", before=_step, nullable=True)]
Seconds = Annotated[float, Bound("float", before=_finite, ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Timestamp = Annotated[float, Bound("float", before=_finite, ge=0, le=1e11, allow_inf_nan=False)]
Pid = Annotated[int, Bound("int", ge=1, le=MAX_PID)]
Flag = Annotated[bool, Bound("bool")]
Text = Annotated[str, Bound("str", before=_cut)]
Note = Annotated[str, Bound("str", before=_cut_note)]
FsPath = Annotated[str, Bound("str", max_length=MAX_PATH)]
TierName = Literal["ram", "disk"]
Rank = Annotated[int, Bound("int", ge=0, lt=MAX_WORLD)]
WorldSize = Annotated[int, Bound("int", ge=1, le=MAX_WORLD)]
Epoch = Annotated[int, Bound("int", ge=0, le=MAX_EPOCH)]
Tick = Annotated[int, Bound("int", ge=0, le=MAX_STEP)]   # safepoint calls since attach
Seq = Annotated[int, Bound("int", ge=1, le=MAX_STEP)]     # a checkpoint's number
# A part file of a multi-rank checkpoint: a bare name in the job's checkpoint directory, never a
# path (runtime/ckparts.py names them; rank 0 checks the same pattern again before it commits).
PartFile = Annotated[str, Bound("str", pattern=r"^ckpt-[0-9]{6,12}\.r[0-9]{1,4}\.pt$", max_length=40)]
Sha256 = Annotated[str, Bound("str", pattern=r"^[0-9a-f]{64}$")]
SignalName = Annotated[str, Bound("str", max_length=16)]
# Where a rank's cursor stands (runtime/rankcursor.py), said again in `hello` after a reconnect.
CursorPhase = Literal["running", "asked", "holding", "ready", "parked", "unparked", "written"]
# A rank as the coordinator lists it (runtime/agreement_state.py, RankState.state).
RankStateName = Literal["running", "holding", "ready", "parked", "unparked", "written", "done", "gone"]
# What the runtime says beside its report and no supervisor reads (kept on the wire for tools
# that read the channel): a value that fails is dropped, never the message.
AsideText = Annotated[Optional[str], Bound("str", nullable=True, lenient=True, max_length=MAX_TEXT)]
AsideBytes = Annotated[Optional[int], Bound("int", nullable=True, lenient=True, ge=0, le=MAX_BYTES)]
AsideFlag = Annotated[Optional[bool], Bound("bool", nullable=True, lenient=True)]
