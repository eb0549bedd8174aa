"""A job's lifecycle: which event may move a job from which state to which, in one table.

Every state change the daemon records is an event of a kind (`EventKind`); the store refuses a
change whose (state, kind) -> state is not an edge here (`check`), so a rule nobody wrote down
cannot be taken silently. The simulator asks the same table whether a decision fits a job's phase,
the API whether a job can be paused, resumed or cancelled, and docs/architecture.md draws its
state diagram from it (`mermaid`). No I/O: the policy, the simulator, the daemon and the API all
import it.

What each state carries on the job's record is the second table here (`CARRIES`), and the store
checks every record it writes against it (`violations`): a RUNNING job without its GPUs, a PAUSED
one with no tier it is parked in and no SIGSTOP, an ended one without its end time is refused like
an illegal edge.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from gpuswap.jobs import JobState

P, R, PG, PD, RS = JobState.PENDING, JobState.RUNNING, JobState.PAUSING, JobState.PAUSED, JobState.RESUMING
COMPLETED, FAILED, CANCELLED = JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED
STARTED = (R, PG, PD, RS)          # a job with (or that had) a process of this generation


class EventKind(str, enum.Enum):
    """What an event records; the value is what the database and the API hold."""

    SUBMITTED = "submitted"
    STARTED = "started"
    PARK_STARTED = "park_started"          # the controller asked the job (or the driver) to park it
    PARKED_RAM = "parked_ram"              # its runtime moved its GPU memory to host RAM
    PARKED_DISK = "parked_disk"            # its runtime wrote a disk checkpoint and exited (requeued)
    FROZEN = "frozen"                      # the driver checkpointed it into host RAM
    SIGSTOPPED = "sigstopped"              # no park possible: stopped, its memory stays on the GPU
    PARK_FAILED = "park_failed"            # the park was tried and failed; it keeps running
    CANNOT_PARK = "cannot_park"            # no runtime / no safepoint: left running, never asked again
    CANNOT_FREEZE = "cannot_freeze"        # the driver path refused: left running, not frozen again
    RESUME_STARTED = "resume_started"      # given GPUs again: restoring from RAM, thawing or restarting
    RESUMED_RAM = "resumed_ram"
    RESTARTED_DISK = "restarted_disk"
    THAWED = "thawed"
    CONTINUED = "continued"                # SIGCONT of a SIGSTOPped job
    SPILL_REQUESTED = "spill_requested"    # a RAM-parked job is to move to disk (policy or user)
    SPILLED = "spilled"
    SPILL_FAILED = "spill_failed"
    REQUEUED = "requeued"                  # its pool node lost for good: back to its last disk checkpoint
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Notes: recorded in any live state, they change no state.
    PAUSE_REQUESTED = "pause_requested"    # a user's hold (API)
    PAUSE_DEFERRED = "pause_deferred"      # a user's pause kept until the runtime attaches
    PAUSE_REFUSED = "pause_refused"        # a user's pause to a tier the job cannot be parked to
    RESUME_REQUESTED = "resume_requested"  # a user's hold dropped (API)
    CANCEL_REQUESTED = "cancel_requested"
    RESTORE_DEFERRED = "restore_deferred"  # a thaw waits for room on its GPUs
    PUT_BACK = "put_back"                  # what a freeze given up on took is given back (restore, unlock)
    ABORTING = "aborting"                  # the daemon stops a job that cannot go on; it ends FAILED
    WAITING = "waiting"                    # why a pending or paused job waits (the policy's reason)
    STEP_FAILED = "step_failed"            # gpuswap failed a step for this job; it retries


K = EventKind


@dataclass(frozen=True)
class Edge:
    source: Optional[JobState]       # None: the job did not exist
    kind: EventKind
    target: JobState
    why: str = ""                    # for an edge that is not obvious: why it is legal


def _each(sources: Iterable[JobState], kind: EventKind, target: JobState, why: str = "") -> list[Edge]:
    return [Edge(s, kind, target, why) for s in sources]


EDGES: tuple[Edge, ...] = (
    Edge(None, K.SUBMITTED, P),
    Edge(P, K.STARTED, R),
    Edge(R, K.PARK_STARTED, PG),
    Edge(PG, K.PARKED_RAM, PD),
    Edge(PG, K.PARKED_DISK, PD),
    # The runtime's checkpoint to disk can complete after the daemon stopped asking for it: a park it
    # gave up on (cannot_park or park_failed raced the runtime's last safepoint), or a spill that a
    # resume overtook. The checkpoint is written and the process has exited 75: the job is parked on
    # disk and requeued, as node/observe.py has always recorded it.
    *_each((R, RS), K.PARKED_DISK, PD, "a checkpoint to disk that completed after its request was dropped"),
    Edge(PG, K.FROZEN, PD),
    Edge(PG, K.SIGSTOPPED, PD),
    Edge(PG, K.PARK_FAILED, R),
    Edge(PG, K.CANNOT_PARK, R),
    Edge(PG, K.CANNOT_FREEZE, R),
    Edge(PD, K.RESUME_STARTED, RS),
    Edge(RS, K.RESUMED_RAM, R),
    Edge(RS, K.RESTARTED_DISK, R),
    Edge(RS, K.THAWED, R),
    Edge(PD, K.CONTINUED, R),
    # A parked job stays PAUSED while its tier changes from RAM to disk.
    Edge(PD, K.SPILL_REQUESTED, PD),
    Edge(PD, K.SPILLED, PD),
    Edge(PD, K.SPILL_FAILED, PD),
    # A pool's node lost for good (docs/ray.md): a job of it whose last disk checkpoint is on storage
    # other nodes reach goes back to that checkpoint, parked on disk, to resume on one of them.
    *_each(STARTED, K.REQUEUED, PD, "its node lost for good; its last disk checkpoint is reachable elsewhere"),
    # A job with a process ends however it is moving: its exit is a fact, whatever was asked of it.
    *_each(STARTED, K.COMPLETED, COMPLETED),
    *_each(STARTED, K.FAILED, FAILED),
    Edge(P, K.CANCELLED, CANCELLED),
    *_each(STARTED, K.CANCELLED, CANCELLED),
)
NOTES = frozenset({K.PAUSE_REQUESTED, K.PAUSE_DEFERRED, K.PAUSE_REFUSED, K.RESUME_REQUESTED, K.CANCEL_REQUESTED,
                   K.RESTORE_DEFERRED, K.PUT_BACK, K.ABORTING, K.WAITING, K.STEP_FAILED})
_TARGET = {(e.source, e.kind): e.target for e in EDGES}
_MOVES = frozenset(e.kind for e in EDGES)

# What a kind says by itself about where the job's state goes and how: (tier, mechanism). An event
# may carry others (a park request names its tier and mechanism); these fill what it leaves out.
# Tier "gpu": a SIGSTOPped job's memory stays on its GPU.
IMPLIED: dict[EventKind, tuple[Optional[str], Optional[str]]] = {
    K.PARKED_RAM: ("ram", "cooperative"), K.PARKED_DISK: ("disk", "cooperative"),
    K.FROZEN: ("ram", "transparent"), K.SIGSTOPPED: ("gpu", "sigstop"), K.CONTINUED: ("gpu", "sigstop"),
    K.RESUMED_RAM: ("ram", "cooperative"), K.RESTARTED_DISK: ("disk", "cooperative"),
    K.THAWED: ("ram", "transparent"), K.CANNOT_FREEZE: (None, "transparent"),
    K.SPILL_REQUESTED: ("disk", "cooperative"), K.SPILLED: ("disk", "cooperative"),
    K.SPILL_FAILED: ("disk", "cooperative"), K.REQUEUED: ("disk", "cooperative"),
}


class IllegalTransition(ValueError):
    """A state change the lifecycle table does not allow: a bug in the code that asked for it."""


def target(source: Optional[JobState], kind: EventKind) -> JobState:
    """The state an event of `kind` moves a job in `source` (None: a new job) to (a note: `source`)."""
    kind = EventKind(kind)
    if kind in NOTES and source is not None:
        return source
    try:
        return _TARGET[(source, kind)]
    except KeyError:
        where = "a new job" if source is None else f"a job in {source.value}"
        raise IllegalTransition(f"{where} cannot take an event {kind.value!r}") from None


def allows(source: JobState, kind: EventKind) -> bool:
    return kind in NOTES or (source, kind) in _TARGET


def check(source: JobState, kind: Optional[EventKind], new: Optional[JobState]) -> None:
    """Raise IllegalTransition unless an event of `kind` may move a job from `source` to `new`
    (None: the change leaves the state as it is)."""
    if kind is None:
        if new is not None and new != source:
            raise IllegalTransition(f"a change of state ({source.value} -> {new.value}) needs an event kind")
        if new is None:
            return
        raise IllegalTransition(f"a write of state {new.value} needs an event kind")
    want = target(source, kind)
    if new is not None and new != want:
        raise IllegalTransition(f"an event {EventKind(kind).value!r} moves a job in {source.value} to "
                                f"{want.value}, not {new.value}")
    if new is None and kind in _MOVES and want != source:
        raise IllegalTransition(f"an event {EventKind(kind).value!r} moves a job in {source.value} to "
                                f"{want.value}; the change must say so")


@dataclass(frozen=True)
class NewEvent:
    """An event as code records it: what happened (`kind`), the sentence people read, and the facts
    the metrics and the dashboard read instead of the sentence. `tier` and `mechanism` left None
    take what the kind implies (IMPLIED); `initiator` ('policy' | 'user') says who asked."""

    kind: Optional[EventKind]
    text: str
    tier: Optional[str] = None
    mechanism: Optional[str] = None
    initiator: Optional[str] = None

    def facts(self) -> tuple[Optional[str], Optional[str], Optional[str]]:
        """(kind, tier, mechanism) as the events table holds them."""
        if self.kind is None:
            return None, self.tier, self.mechanism
        tier, mechanism = IMPLIED.get(self.kind, (None, None))
        return EventKind(self.kind).value, self.tier or tier, self.mechanism or mechanism


# The API's checks, read off the table. A job with a process: one that can still complete.
_WITH_PROCESS = frozenset(e.source for e in EDGES if e.kind is K.COMPLETED)


def may_cancel(state: JobState) -> bool:
    """A cancel request can end it: the table has a way from `state` to CANCELLED."""
    return (state, K.CANCELLED) in _TARGET


def may_pause(state: JobState) -> bool:
    """A user's hold means something: the job has a process (running, or moving between its GPU
    and a tier, where the hold then stands)."""
    return state in _WITH_PROCESS


def may_resume(state: JobState) -> bool:
    """A user's hold can be dropped: the same started, not ended jobs."""
    return state in _WITH_PROCESS


class RequestTooLate(IllegalTransition):
    """A user's request that found its job in a state it cannot mean anything in: the job changed
    (it ended) between the API's read of it and the write of the request. Not a bug: an answer."""

    def __init__(self, state: JobState, kind: EventKind):
        super().__init__(f"a {kind.value} on a job that is {state.value}")
        self.state = state


# A user's request is written only where it still means something, checked in the write's own
# transaction: the API checks first, but a job that ends between that read and the write must keep
# its end (its reason, its last event), not take the request's sentence as its reason.
_REQUESTS = {K.CANCEL_REQUESTED: may_cancel, K.PAUSE_REQUESTED: may_pause, K.RESUME_REQUESTED: may_resume}
REQUESTS = frozenset(_REQUESTS)


def check_request(state: JobState, kind: Optional[EventKind]) -> None:
    """Raise RequestTooLate where `kind` is a user's request that `state` no longer admits."""
    allowed = _REQUESTS.get(kind) if kind is not None else None
    if allowed is not None and not allowed(state):
        raise RequestTooLate(state, kind)


@dataclass(frozen=True)
class Parked:
    """Where a PAUSED (or RESUMING) job's GPU state is, as one record."""

    tier: str                   # ram | disk
    mechanism: Optional[str]    # cooperative | transparent
    nbytes: int
    home_gpus: tuple[int, ...]  # the GPUs it ran on (a RAM park's CUDA context stays there)

    @classmethod
    def of(cls, job: Any) -> Optional["Parked"]:
        """From a job record (node/records.py's JobRecord), None when nothing is parked."""
        if job.parked is None:
            return None
        return cls(job.parked, job.mechanism, int(job.parked_bytes), tuple(job.home_gpus))


# -- what each state carries ---------------------------------------------------------------------
# One row per state and, for PAUSED and RESUMING, per place its GPU state is (`parked`): which of
# the record's fields it must and must not carry. Derived from what the code writes and reads (the
# controller, node/observe.py, node/freezer.py); the `why` of a row says what is not obvious.
COOPERATIVE, TRANSPARENT = "cooperative", "transparent"
PARKING = frozenset({COOPERATIVE, TRANSPARENT})


@dataclass(frozen=True)
class Carries:
    """What a job in `state`, its GPU state in `parked` (ram | disk | None), carries."""

    state: JobState
    parked: Optional[str]
    gpus: bool                    # `assigned`: its GPUs, as many as it asked for; False: none
    home: bool                    # `home_gpus`: where a RAM park's CUDA context stays, one per GPU; False: none
    mechanisms: Optional[frozenset[str]] = None   # the `mechanism` it may have (None: any, or none)
    stopped: Optional[bool] = False   # True: SIGSTOPped; False: not; None: either
    ended: bool = False           # its end time (and exit code or signal, if a process exited); False: none
    also: tuple[tuple[str, Callable[[Any], bool]], ...] = ()   # other facts: (what it says, test)
    why: str = ""


def _transparent_if_stopped(j: Any) -> bool:
    return not j.stopped or j.mechanism == TRANSPARENT


_FROZEN_STOP = ("stopped only if the driver froze it", _transparent_if_stopped)
_SIZE = ("the size of what is parked (parked_bytes >= 0)", lambda j: (j.parked_bytes or 0) >= 0)

CARRIES: tuple[Carries, ...] = (
    Carries(P, None, gpus=False, home=False),
    Carries(R, None, gpus=True, home=False, also=(
        ("asks its supervisor to run (desired running)", lambda j: j.desired == "running"),),
        why="every way back to RUNNING clears the park (parked, home GPUs), the stop and the request to park; "
            "a job stopped by the SIGSTOP fallback is PAUSED (PAUSING until the stop is confirmed)"),
    Carries(PG, None, gpus=True, home=False, mechanisms=PARKING, stopped=None, also=(
        ("the tier asked for (desired_tier ram or disk)", lambda j: j.desired_tier in ("ram", "disk")),
        ("the time it was asked (pause_requested_at)", lambda j: j.pause_requested_at is not None)),
        why="still on its GPUs; stopped while the SIGSTOP fallback or the driver's last step is confirmed"),
    Carries(PD, "ram", gpus=False, home=True, mechanisms=PARKING, stopped=None, also=(_FROZEN_STOP, _SIZE),
            why="its runtime's memory or the driver's checkpoint is in host RAM; a driver-frozen tree stays "
                "stopped; a spill to disk under way keeps this shape until its checkpoint is written"),
    Carries(PD, "disk", gpus=False, home=False, mechanisms=frozenset({COOPERATIVE}), also=(_SIZE,),
            why="its process exited after writing the checkpoint (also when the checkpoint completed after "
                "its request was dropped: a park given up on, or a spill a resume overtook)"),
    Carries(PD, None, gpus=True, home=False, stopped=True,
            why="the SIGSTOP fallback: nothing was moved, its memory stays on its GPUs"),
    Carries(RS, "ram", gpus=True, home=True, mechanisms=PARKING, stopped=None, also=(_FROZEN_STOP, _SIZE),
            why="given GPUs again, it keeps its parked data until the resume is confirmed; a driver-frozen "
                "tree is continued before the driver restores it (home GPUs: where the thaw maps from)"),
    Carries(RS, "disk", gpus=True, home=False, mechanisms=frozenset({COOPERATIVE}), also=(_SIZE,),
            why="restarted on its new GPUs; parked until its runtime reports the restore"),
    *(Carries(s, None, gpus=False, home=False, ended=True,
              why="no exit code or signal when no process of it exited (cancelled before it ran or while "
                  "parked on disk; its supervisor died)") for s in (COMPLETED, FAILED, CANCELLED)),
)
_CARRIES = {(c.state, c.parked): c for c in CARRIES}
# The fields the table reads: a change of none of them (and not of the state) cannot break a row.
CARRIED_FIELDS = frozenset({"state", "parked", "parked_bytes", "assigned", "home_gpus", "gpus", "mechanism",
                            "stopped", "end_time", "exit_code", "signal", "desired", "desired_tier",
                            "pause_requested_at"})


class InvalidRecord(IllegalTransition):
    """A record that does not carry what its state must (CARRIES): a bug in the code that wrote it."""


def violations(job: Any) -> list[str]:
    """What `job` (a record with the JobRecord fields) carries against the table; [] when it fits."""
    state = JobState(job.state)
    row = _CARRIES.get((state, job.parked))
    if row is None:
        return [f"a {state.value} job cannot be parked in {job.parked!r}"]
    out: list[str] = []
    assigned, home = list(job.assigned or []), list(job.home_gpus or [])
    if row.gpus and (len(assigned) != job.gpus or len(set(assigned)) != len(assigned)):
        out.append(f"a {_name(row)} job must hold its {job.gpus} GPU(s); assigned is {assigned}")
    if not row.gpus and assigned:
        out.append(f"a {_name(row)} job must hold no GPU; assigned is {assigned}")
    if row.home and len(home) != job.gpus:
        out.append(f"a {_name(row)} job must keep its {job.gpus} home GPU(s); home_gpus is {home}")
    if not row.home and home:
        out.append(f"a {_name(row)} job must have no home GPUs; home_gpus is {home}")
    if row.parked is None and job.parked_bytes:
        out.append(f"a {_name(row)} job must have nothing parked; parked_bytes is {job.parked_bytes}")
    if row.mechanisms is not None and job.mechanism not in row.mechanisms:
        out.append(f"a {_name(row)} job must be parked by {' or '.join(sorted(row.mechanisms))}; mechanism is "
                   f"{job.mechanism!r}")
    if row.stopped is not None and bool(job.stopped) != row.stopped:
        out.append(f"a {_name(row)} job must {'' if row.stopped else 'not '}be stopped; stopped is {bool(job.stopped)}")
    if row.ended and job.end_time is None:
        out.append(f"a {state.value} job must have its end time; end_time is None")
    if not row.ended and (job.end_time, job.exit_code, job.signal) != (None, None, None):
        out.append(f"a {state.value} job must have no end time, exit code or signal; they are "
                   f"{job.end_time}, {job.exit_code}, {job.signal}")
    for what, holds in row.also:
        if not holds(job):
            out.append(f"a {_name(row)} job must carry {what}")
    return out


def _name(row: Carries) -> str:
    if row.state not in (PD, RS):
        return row.state.value
    return f"{row.state.value} ({'SIGSTOPped' if row.parked is None else 'parked in ' + row.parked})"


def check_record(job: Any, before: Iterable[str] = ()) -> None:
    """Raise InvalidRecord if `job` breaks the table in a way `before` (what the record broke before
    this write) did not: a row an older gpuswap wrote is not stuck for a fault the write did not make."""
    new = [v for v in violations(job) if v not in set(before)]
    if new:
        raise InvalidRecord(f"job {job.id} in {JobState(job.state).value}: " + "; ".join(new))


def carries_table() -> str:
    """CARRIES as a Markdown table (docs/architecture.md holds this text); rows alike but for their
    state are one row."""
    lines = ["| state | parked | assigned | home_gpus | mechanism | stopped | end_time, exit_code, signal | "
             "also | why |", "|---|---|---|---|---|---|---|---|---|"]
    cells: list[tuple[list[str], list[str]]] = []
    for c in CARRIES:
        rest = [f"`{c.parked}`" if c.parked else "none (parked_bytes 0)", "its GPUs" if c.gpus else "none",
                "its GPUs" if c.home else "none",
                " or ".join(sorted(c.mechanisms)) if c.mechanisms else "any",
                {True: "yes", False: "no", None: "either"}[c.stopped],
                "end time (exit code or signal if it exited)" if c.ended else "none",
                "; ".join(what for what, _ in c.also), c.why]
        if cells and cells[-1][1] == rest:
            cells[-1][0].append(c.state.value)
        else:
            cells.append(([c.state.value], rest))
    lines += ["| " + " | ".join([", ".join(states), *rest]) + " |" for states, rest in cells]
    return "\n".join(lines) + "\n"


def mermaid() -> str:
    """The table as a Mermaid state diagram (docs/architecture.md holds this text)."""
    lines = ["stateDiagram-v2"]
    labels: dict[tuple[str, str], list[str]] = {}
    for e in EDGES:
        src = "[*]" if e.source is None else e.source.value
        labels.setdefault((src, e.target.value), []).append(e.kind.value)
    for (src, dst), kinds in labels.items():
        lines.append(f"    {src} --> {dst}: {', '.join(kinds)}")
    for s in (COMPLETED, FAILED, CANCELLED):
        lines.append(f"    {s.value} --> [*]")
    return "\n".join(lines) + "\n"
