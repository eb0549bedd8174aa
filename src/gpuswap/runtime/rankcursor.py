"""One rank's side of the common-step agreement (`agreement.py`), as a pure state machine.

The runtime's reader thread hands every coordinator message to `on_message` (under the job's
lock) and sends what it returns; the training thread, at a safepoint while the pause flag is set,
calls `at_safepoint(tick)`, and each time it wakes while waiting, `wake()`; it carries out the
action it gets (park, unpark, regroup, ...) and reports the outcome with `finished`, which says
what to send. Nothing here touches tensors, sockets or clocks.

The one ordering the caller must keep: on `pause`, set the hot flag *before* reading the tick it
passes as `seen` (and the training thread stores its tick before testing the flag). That makes
`seen + 1` an upper bound of where this rank stops, which the coordinator's target relies on.

Ticks count safepoint calls since `attach` (1 for the first), not the user's step numbers: a
loop may number its steps per epoch, and the agreement needs a counter every rank advances the
same way. The user's step is reported beside it for people.
"""
from __future__ import annotations

from typing import Any, Optional

from gpuswap.protocol import records as m

# What the training thread is told to do.
CONTINUE, WAIT, PARK, UNPARK, REGROUP, RELEASE, WRITE, COMMIT, EXIT = (
    "continue", "wait", "park", "unpark", "regroup", "release", "write", "commit", "exit")

_QUEUED = (m.Park, m.Resume, m.Regroup, m.Release, m.Commit, m.Exit)


class RankCursor:
    """Where this rank stands in the current attempt.

    phase: running (no attempt) | asked (flag set; train on while below the target) | holding
    (waiting for a target) | ready (at the target) | parked (memory released, or a park that
    failed and waits for resume) | unparked | written (its checkpoint part is durable).

    Instructions are kept in arrival order and carried out in that order: a `resume` that comes
    right behind a `park` (the park failed on another rank) must still find this rank parked,
    so that it answers `unparked` like every other rank.
    """

    def __init__(self) -> None:
        self.phase = "running"
        self.epoch: Optional[int] = None
        self.target: Optional[int] = None
        self.at: Optional[int] = None          # the tick the training thread waits at
        self.queue: list[m.Order] = []         # instructions not yet carried out
        self.tier: Optional[str] = None        # of the park being carried out
        self.parts: tuple[m.PartRef, ...] = ()  # commit: every rank's part (rank 0)
        self.rebuild = True                    # regroup: the process group must be made again
        self.parked_bytes = 0

    @property
    def flagged(self) -> bool:
        """The safepoint must come to `at_safepoint`: an attempt is on and this rank still moves."""
        return self.phase == "asked"

    # -- reader thread -------------------------------------------------------------------------
    def on_message(self, msg: m.Order, seen: int) -> list[m.Report]:
        epoch = msg.epoch
        if isinstance(msg, m.Pause):
            if epoch is None or self.phase not in ("running", "asked", "holding"):
                return []        # a single-rank pause, or parked or writing: no attempt starts here
            self.phase, self.epoch = "asked", epoch
            self.target, self.at, self.queue = None, None, []
            return [m.Mark(epoch=epoch, seen=seen)]
        if epoch != self.epoch or self.epoch is None:
            return []            # an attempt that is over
        if isinstance(msg, m.Target) and self.phase in ("asked", "holding"):
            self.target = msg.tick
        elif isinstance(msg, _QUEUED):
            self.queue.append(msg)
        return []

    # -- training thread -----------------------------------------------------------------------
    def at_safepoint(self, tick: int) -> tuple[str, list[m.Report]]:
        """The training thread is at safepoint `tick` with the flag set."""
        if self.phase != "asked":
            return CONTINUE, []
        if any(isinstance(q, m.Resume) for q in self.queue):
            return self._cancel()
        if self.target is None:
            self.phase, self.at = "holding", tick
            return WAIT, [m.Hold(epoch=self._epoch, tick=tick)]
        return self._against_target(tick)

    def wake(self) -> tuple[str, list[m.Report]]:
        """The training thread woke while waiting: what now?"""
        while self.queue:
            msg = self.queue.pop(0)
            step = self._apply(msg)
            if step is not None:
                return step
        if self.phase == "holding" and self.target is not None:
            assert self.at is not None
            return self._against_target(self.at)
        return WAIT, []

    def _apply(self, msg: m.Order) -> Optional[tuple[str, list[m.Report]]]:
        """Carry out one instruction if it applies where this rank stands (else drop it)."""
        p = self.phase
        if isinstance(msg, m.Resume) and p in ("asked", "holding", "ready"):
            return self._cancel()                      # withdrawn before anything was torn down
        if isinstance(msg, m.Resume) and p in ("parked", "written"):
            return UNPARK, []                          # a no-op for a park that released nothing
        if isinstance(msg, m.Park) and (p == "ready" or (p == "parked" and msg.tier == "disk")):
            self.tier = msg.tier
            return (WRITE if self.tier == "disk" else PARK), []
        if isinstance(msg, m.Regroup) and p == "unparked":
            self.rebuild = msg.rebuild
            return REGROUP, []
        if isinstance(msg, m.Release) and p == "written":   # a spill failed elsewhere: still parked in RAM
            self.phase = "parked"
            return WAIT, [m.Paused(epoch=self._epoch, bytes=self.parked_bytes)]
        if isinstance(msg, m.Release) and p in ("unparked", "parked"):
            return RELEASE, []                         # a no-op where nothing came back
        if isinstance(msg, m.Commit) and p == "written":
            self.parts = msg.parts
            return COMMIT, []
        if isinstance(msg, m.Exit) and p == "written":
            return EXIT, []
        return None

    def finished(self, action: str, ok: bool, info: Optional[dict[str, Any]] = None) -> list[m.Report]:
        """The outcome of an action `wake` asked for; returns what to send. `info`: the fields of
        the report that says so (bytes, seconds, step, group_s; a part's file and digest; a
        commit's seq and path; a failure's message)."""
        info = dict(info or {})
        e = self._epoch
        if not ok:
            if action in (PARK, WRITE) and self.phase == "ready":
                self.phase = "parked"      # memory back where it was; waits for resume like a park
            elif action == UNPARK:
                self.phase = "parked"
            return [m.Error(epoch=e, message=str(info.get("message") or f"{action} failed"))]
        if action == PARK:
            self.phase, self.parked_bytes = "parked", int(info.get("bytes") or 0)
            return [m.Paused(epoch=e, tier="ram", **info)]
        if action == WRITE:
            self.phase = "written"
            return [m.Part(epoch=e, **info)]
        if action == COMMIT:
            return [m.Committed(epoch=e, **info)]
        if action == UNPARK:
            self.phase = "unparked"
            return [m.Unparked(epoch=e, **info)]
        if action == RELEASE:
            self.phase = "parked"
            return [m.Paused(epoch=e, bytes=self.parked_bytes)]
        if action == REGROUP:
            self._reset()
            return [m.Resumed(epoch=e, **info)]
        return []

    # -- helpers -------------------------------------------------------------------------------
    @property
    def _epoch(self) -> int:
        """The current attempt's epoch (there is one wherever a report is sent)."""
        assert self.epoch is not None
        return self.epoch

    def _against_target(self, tick: int) -> tuple[str, list[m.Report]]:
        target = self.target
        assert target is not None
        if tick < target:
            self.phase, self.at = "asked", None
            return CONTINUE, []
        if tick == target:
            self.phase, self.at = "ready", tick
            return WAIT, [m.Ready(epoch=self._epoch, tick=tick)]
        e = self._epoch
        self._reset()
        return CONTINUE, [m.Error(epoch=e, message=f"passed the common step {target}")]

    def _cancel(self) -> tuple[str, list[m.Report]]:
        e = self.epoch
        self._reset()
        return CONTINUE, [m.Resumed(epoch=e, bytes=0, seconds=0.0)]

    def _reset(self) -> None:
        self.phase, self.target, self.at, self.queue = "running", None, None, []
