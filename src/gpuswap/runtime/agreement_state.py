"""What the common-step coordinator (`agreement.py`) holds and emits: the job's phases, the
effects it asks its driver to carry out, and its record of each rank and of the current attempt.
Kept apart so the supervisor, `show` and the tests can name them without the state machine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from gpuswap.protocol.records import Order, Report

# Phases of the job as a whole.
RUNNING, AGREEING, PARKING, PARKED = "running", "agreeing", "parking", "parked"
UNPARKING, REGROUPING, COMMITTING, CHECKPOINTED = "unparking", "regrouping", "committing", "checkpointed"
FAILED = "failed"


@dataclass(frozen=True)
class Send:
    """A message for one rank."""

    rank: int
    msg: Order


@dataclass(frozen=True)
class Kill:
    """The job cannot go on (a rank died or hung after the group was torn down): end all of it."""

    reason: str


Effect = Union[Send, Kill]


@dataclass
class RankState:
    """What the coordinator knows of one rank, as `show` lists it."""

    rank: int
    pid: Optional[int] = None
    connected: bool = True
    state: str = "running"   # running, holding, ready, parked, unparked, written, done, gone
    tick: Optional[int] = None
    step: Optional[int] = None
    device_bytes: int = 0
    ram_refusal: Optional[str] = None   # why this rank cannot rebuild its group (then: disk)


@dataclass
class Attempt:
    """One try at parking the job (its epoch): kept until the job runs again or fails, so that
    late and stale reports can be told apart."""

    epoch: int
    since: float                       # when the current phase began
    started: float                     # when the pause was asked for
    resume_asked: Optional[float] = None   # when the resume was asked for (resume_s counts from it)
    bounds: dict[int, int] = field(default_factory=dict)   # rank -> the latest tick it can stop at
    held: set[int] = field(default_factory=set)
    target: Optional[int] = None
    tier: Optional[str] = None
    ready: set[int] = field(default_factory=set)
    answered: dict[int, Report] = field(default_factory=dict)   # this phase's reports
    progress: dict[int, float] = field(default_factory=dict)   # rank -> when its checkpoint write last moved
    parked_in_ram: bool = False        # memory released and groups destroyed on every rank
    why_disk: Optional[str] = None
