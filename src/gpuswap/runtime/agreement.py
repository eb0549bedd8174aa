"""The common-step agreement of a multi-rank job, as a pure state machine: facts in, messages out.

Why it exists: the ranks of a data-parallel job meet in collectives every step. A rank that
parks (its process group destroyed, its memory released) while a peer has already entered the
next step's collective leaves that peer blocked until NCCL's timeout kills the job. So every
rank must stop at one safepoint T, none may pass T, and none may tear anything down before all
are at T. The agreement runs over the control channel (one connection per rank to the
supervisor, or to the in-job coordinator under Slurm), never over the job's own process group:
a rank blocked in a collective cannot take part in another one, but its reader thread always
answers the control channel. No I/O, no clock (`now` is passed in), no threads: the supervisor
and the tests drive the same code. docs/design/multi-rank.md has the reasoning.

Protocol (epoch e numbers one attempt; every message carries it; stale ones are ignored):

    coordinator                rank r
    pause{e,tier}       ──▶    reader: sets the pause flag, then reads its tick s  ──▶ mark{e,s}
                               training thread, first flagged safepoint p, no target ──▶ hold{e,p}
    every rank bounded: T = max(p if held else s+1)
    target{e,T}         ──▶    below T: trains on; at T                           ──▶ ready{e,T}
    every rank ready (nobody can be inside a collective any more):
    park{e,ram}         ──▶    destroy its process group, release memory          ──▶ paused{e,bytes}
    park{e,disk}        ──▶    write its part of the checkpoint                   ──▶ part{e,file,...}
    commit{e,parts}     ──▶    (rank 0 only) write the manifest of every part     ──▶ committed{e,seq}
    exit{e}             ──▶    exit 75 (requeue)
    resume{e}           ──▶    before park: train on; after: bring memory back    ──▶ unparked{e}
    regroup{e}          ──▶    create the process group again, rebind DDP/FSDP    ──▶ resumed{e}
    release{e}          ──▶    an unpark failed elsewhere: free the memory again  ──▶ paused{e,bytes}

T bounds every rank: the reader sets the flag before it reads the tick and the training thread
stores its tick before it tests the flag, so a rank whose reader read s stops at s or s+1, never
later (`rankcursor.py` is the rank's side). Every rank reaches T: once the target is sent no rank
waits below T, so every collective of a step <= T is entered by all ranks.
"""
from __future__ import annotations

from typing import Any, Optional

from gpuswap.protocol import records as m
from gpuswap.runtime.agreement_state import (  # noqa: F401  (re-exported)
    AGREEING, CHECKPOINTED, COMMITTING, FAILED, PARKED, PARKING, REGROUPING, RUNNING, UNPARKING,
    Attempt, Effect, Kill, RankState, Send)


class Coordinator:
    """One per multi-rank job. Inputs: `hello`, `receive`, `lost`, `want`, `poll`; each returns
    the effects to carry out. `facts()` is the job-level summary a supervisor writes to status."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.world_size: Optional[int] = None
        self.ranks: dict[int, RankState] = {}
        self.phase = RUNNING
        self.attempt: Optional[Attempt] = None
        self.epoch = 0
        self.desired: tuple[str, Optional[str]] = ("running", None)   # ("paused", tier) too
        self.max_bytes: Optional[int] = None
        self.error: Optional[str] = None
        self.error_at: Optional[float] = None
        self.refusal: Optional[str] = None       # why the job cannot be paused now
        self.result: dict[str, Any] = {}          # bytes, step, pause_s, resume_s, ckpt_path, tier
        self.written: dict[int, int] = {}         # rank -> bytes it has written to checkpoint files

    # -- inputs ------------------------------------------------------------------------------
    def hello(self, rank: int, world_size: int, now: float, pid: Optional[int] = None,
              epoch: Optional[int] = None, state: str = "running",
              ram_refusal: Optional[str] = None) -> list[Effect]:
        """A rank (re)connected and said who it is and where it stands."""
        if self.world_size is None:
            self.world_size = world_size
        if world_size != self.world_size or not 0 <= rank < self.world_size:
            self.refusal = f"rank {rank} says the world has {world_size} ranks, not {self.world_size}"
            return []
        old = self.ranks.get(rank)
        if old is not None and old.connected and old.pid != pid:
            return []   # a second process claims a live rank: the supervisor closes that connection
        self.ranks[rank] = RankState(rank, pid, True, state, ram_refusal=ram_refusal)
        out: list[Effect] = []
        a = self.attempt
        if a is not None and old is not None:
            out += self._lose(rank, now, f"rank {rank} reconnected during the pause")
        elif epoch is not None and state != "running" and (a is None or epoch != a.epoch):
            out.append(Send(rank, m.Resume(epoch=epoch)))   # left waiting by a past attempt
        return out + self._reconcile(now)

    def receive(self, rank: int, msg: m.Report, now: float) -> list[Effect]:
        """A rank's report, validated by the gate (protocol/messages.py)."""
        r = self.ranks.get(rank)
        if r is None:
            return []
        if isinstance(msg, m.Usage):
            r.device_bytes, r.step = msg.device_bytes, msg.step if msg.step is not None else r.step
            if msg.written is not None and msg.written > self.written.get(rank, 0):
                self.written[rank] = msg.written
                if self.attempt is not None and self.phase in (PARKING, COMMITTING):
                    self.attempt.progress[rank] = now     # its part (or the manifest) is being written
            return []
        if isinstance(msg, m.Done):
            r.state = "done"
            return self._withdraw(now, f"rank {rank} finished training") if self.phase == AGREEING else []
        a = self.attempt
        if a is None or getattr(msg, "epoch", None) != a.epoch:
            return []
        if isinstance(msg, m.Error):
            return self._failed(rank, msg.message or "error", now)
        handler = _HANDLERS.get((self.phase, msg.op))
        return handler(self, rank, msg, now) if handler is not None else []

    def lost(self, rank: int, now: float) -> list[Effect]:
        """A rank's connection closed (it exited, or its runtime went away)."""
        r = self.ranks.get(rank)
        if r is None or not r.connected:
            return []
        r.connected = False
        if r.state != "done":
            r.state = "gone"
        if self.phase == CHECKPOINTED or r.state == "done":
            return []
        return self._lose(rank, now, f"rank {rank} exited or disconnected")

    def want(self, run: str, tier: Optional[str], now: float, max_bytes: Optional[int] = None) -> list[Effect]:
        """What the daemon wants: ("running", None), ("paused", "ram"|"disk")."""
        self.desired, self.max_bytes = (run, tier), max_bytes
        return self._reconcile(now)

    def poll(self, now: float) -> list[Effect]:
        """Deadlines: a move (agreeing, parking, committing, unparking, regrouping) that outlives
        the pause timeout ends with its reason. Parked is not a move: a job stays parked in RAM
        for as long as the daemon wants (hours), and a parked rank has nothing left to answer."""
        a = self.attempt
        if a is None or self.phase in (PARKED, CHECKPOINTED, FAILED) or now - a.since <= self.timeout_s:
            return []       # checkpointed: the job is done with, its exit is the launcher's; failed: killed once
        late = sorted(set(self.ranks) - (a.ready if self.phase == AGREEING else set(a.answered)))
        # A checkpoint being written is a move that takes as long as the disk needs (a large job,
        # a slow filesystem): the timeout runs from the last progress a late rank reported (its
        # bytes written, in usage), so a stuck rank is still caught and a writing one never killed.
        if late and self.phase in (PARKING, COMMITTING) and all(
                now - max(a.since, a.progress.get(r, a.since)) <= self.timeout_s for r in late):
            return []
        who = ", ".join(f"rank {r} (at tick {self.ranks[r].tick})" for r in late) or "no rank"
        if self.phase == AGREEING:
            where = f"step {a.target}" if a.target is not None else "a safepoint"
            return self._withdraw(now, f"{who} did not reach {where} within {self.timeout_s:g} s")
        return self._kill(f"{who} did not finish {self.phase} within {self.timeout_s:g} s")

    # -- what the job may do -----------------------------------------------------------------
    def pausable(self) -> Optional[str]:
        """None if a pause may start now, else why not (for status and `show`)."""
        if self.refusal:
            return self.refusal
        if self.world_size is None:
            return "no rank attached yet"
        live = [r for r in self.ranks.values() if r.connected and r.state != "done"]
        if len(live) < self.world_size:
            done = [r.rank for r in self.ranks.values() if r.state == "done"]
            if done:
                return f"rank {done[0]} finished training"
            return f"{len(live)} of {self.world_size} ranks attached"
        return None

    def facts(self) -> dict[str, Any]:
        """The job-level runtime facts (status.json `runtime`), in the single-rank vocabulary."""
        state = {PARKED: "paused", CHECKPOINTED: "checkpointed"}.get(self.phase, "running")
        out: dict[str, Any] = {"state": state, "phase": self.phase, "world_size": self.world_size,
                               "attached": self.world_size is not None and len(self.ranks) == self.world_size,
                               "device_bytes": sum(r.device_bytes for r in self.ranks.values()),
                               "ranks": [vars(r).copy() for r in sorted(self.ranks.values(), key=lambda r: r.rank)]}
        out.update(self.result)
        if self.error is not None:
            out.update(error=self.error, error_at=self.error_at)
        if self.attempt is not None and self.attempt.target is not None:
            out["target_tick"] = self.attempt.target
        return out

    # -- moves -------------------------------------------------------------------------------
    def _to_all(self, msg: m.Order) -> list[Effect]:
        return [Send(r, msg) for r, st in sorted(self.ranks.items()) if st.connected]

    def _enter(self, phase: str, now: float) -> None:
        self.phase = phase
        if self.attempt is not None:
            self.attempt.since, self.attempt.answered = now, {}

    def _reconcile(self, now: float) -> list[Effect]:
        run, tier = self.desired
        if self.phase == RUNNING and run == "paused" and tier in ("ram", "disk"):
            if self.pausable() is not None:
                return []
            self.epoch += 1
            self.attempt = Attempt(self.epoch, now, now)
            self.phase, self.error = AGREEING, None
            for r in self.ranks.values():
                r.state = "running"
            return self._to_all(m.Pause(epoch=self.epoch, tier=tier))
        if self.phase == AGREEING and run == "running":
            return self._withdraw(now, None)
        if self.phase == PARKED and run == "running":
            return self._resume(now)
        if self.phase == PARKED and run == "paused" and tier == "disk":   # spill
            return self._park(now, "disk")
        return []

    def _withdraw(self, now: float, reason: Optional[str]) -> list[Effect]:
        """End an agreement before anything was torn down: every rank simply trains on."""
        a = self.attempt
        assert a is not None and self.phase == AGREEING
        out = self._to_all(m.Resume(epoch=a.epoch))
        self.phase, self.attempt = RUNNING, None
        for r in self.ranks.values():
            if r.state in ("holding", "ready"):
                r.state = "running"
        if reason is not None:
            self._note(f"pause withdrawn: {reason}", now)
            self.desired = ("running", None)   # the daemon decides whether to ask again
        return out

    def _bound(self, rank: int, tick: int, exact: bool, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        if a.target is not None:
            return [] if tick <= a.target else self._withdraw(now, f"rank {rank} passed step {a.target}")
        if exact:
            a.held.add(rank)
            a.bounds[rank] = tick
        elif rank not in a.held:
            a.bounds[rank] = tick + 1
        live = {r for r, st in self.ranks.items() if st.connected}
        if not live <= set(a.bounds):
            return []
        a.target = max(a.bounds[r] for r in live)
        return self._to_all(m.Target(epoch=a.epoch, tick=a.target))

    def _on_mark(self, rank: int, msg: m.Mark, now: float) -> list[Effect]:
        self.ranks[rank].tick = msg.seen
        return self._bound(rank, msg.seen, False, now)

    def _on_hold(self, rank: int, msg: m.Hold, now: float) -> list[Effect]:
        r = self.ranks[rank]
        r.state, r.tick = "holding", msg.tick
        return self._bound(rank, r.tick, True, now)

    def _on_ready(self, rank: int, msg: m.Ready, now: float) -> list[Effect]:
        a, r = self.attempt, self.ranks[rank]
        assert a is not None
        if a.target is None or msg.tick != a.target:
            return self._withdraw(now, f"rank {rank} stopped at tick {msg.tick}, not {a.target}")
        r.state, r.tick, r.step = "ready", a.target, msg.step if msg.step is not None else r.step
        a.ready.add(rank)
        if a.ready < {i for i, st in self.ranks.items() if st.connected}:
            return []
        tier = self.desired[1] if self.desired[0] == "paused" else None
        if tier is None:
            return self._withdraw(now, None)
        return self._park(now, tier)

    def _park(self, now: float, tier: str) -> list[Effect]:
        a = self.attempt
        assert a is not None
        refusals = [f"rank {r.rank}: {r.ram_refusal}" for r in self.ranks.values() if r.ram_refusal]
        total = sum(r.device_bytes for r in self.ranks.values())
        if tier == "ram" and refusals:
            tier, a.why_disk = "disk", "cannot rebuild the process group (" + "; ".join(refusals) + ")"
        elif tier == "ram" and self.max_bytes is not None and total > self.max_bytes:
            tier, a.why_disk = "disk", f"{total} bytes exceed the RAM budget's {self.max_bytes}"
        a.tier = tier
        self._enter(PARKING, now)
        return self._to_all(m.Park(epoch=a.epoch, tier=tier))

    def _on_paused(self, rank: int, msg: m.Paused, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        if a.tier != "ram":
            return []       # not an answer to a disk park: the rank's word, never trusted
        r = self.ranks[rank]
        r.state = "parked"
        if msg.step is not None:
            r.step = msg.step             # where it parked: the job's step while parked (usage lags)
        a.answered[rank] = msg
        if len(a.answered) < self.world_size:   # type: ignore[operator]
            return []
        a.parked_in_ram = True
        self.result = {"tier": "ram", "bytes": sum(p.bytes for p in a.answered.values()),
                       "step": self.ranks[0].step, "pause_s": round(now - a.started, 6)}
        group = _slowest(a.answered.values())
        if group is not None:
            self.result["group_teardown_s"] = group
        self._enter(PARKED, now)
        return self._reconcile(now)

    def _on_released(self, rank: int, msg: m.Paused, now: float) -> list[Effect]:
        """A rank parked again after a failed resume or spill (`release`): nothing else to do."""
        self.ranks[rank].state = "parked"
        return []

    def _on_part(self, rank: int, msg: m.Part, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        if a.tier != "disk":
            return []       # not an answer to a RAM park (it was read as one)
        self.ranks[rank].state = "written"
        a.answered[rank] = msg
        if len(a.answered) < self.world_size:   # type: ignore[operator]
            return []
        parts = tuple(m.PartRef(file=p.file, bytes=p.bytes, sha256=p.sha256, seconds=p.seconds, rank=r)
                      for r, p in sorted(a.answered.items()))
        self._enter(COMMITTING, now)
        return [Send(0, m.Commit(epoch=a.epoch, tick=a.target, parts=parts))]

    def _on_committed(self, rank: int, msg: m.Committed, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        if rank != 0:
            return []
        if msg.step is not None:
            self.ranks[0].step = msg.step         # where the checkpoint was taken (usage lags)
        self.result = {"tier": "disk", "bytes": msg.bytes, "step": self.ranks[0].step,
                       "pause_s": round(now - a.started, 6), "ckpt_path": msg.path}
        if a.why_disk:
            self.result["why_disk"] = a.why_disk
        self._enter(CHECKPOINTED, now)
        return self._to_all(m.Exit(epoch=a.epoch))

    def _resume(self, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        a.resume_asked = now
        self._enter(UNPARKING, now)
        return self._to_all(m.Resume(epoch=a.epoch))

    def _on_unparked(self, rank: int, msg: m.Unparked, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        self.ranks[rank].state = "unparked"
        a.answered[rank] = msg
        if len(a.answered) < self.world_size:   # type: ignore[operator]
            return []
        self._enter(REGROUPING, now)
        # Only a RAM park tore groups down; after a failed disk park every group is intact.
        return self._to_all(m.Regroup(epoch=a.epoch, rebuild=a.tier == "ram" or a.parked_in_ram))

    def _on_resumed(self, rank: int, msg: m.Resumed, now: float) -> list[Effect]:
        a = self.attempt
        assert a is not None
        self.ranks[rank].state = "running"
        a.answered[rank] = msg
        if len(a.answered) < self.world_size:   # type: ignore[operator]
            return []
        # From the resume request to every rank training again: unpark and regroup, not the
        # regroup alone (a.since is the current phase's start).
        self.result = {"resume_s": round(now - (a.resume_asked if a.resume_asked is not None else a.since), 6)}
        group = _slowest(a.answered.values())
        if group is not None:
            self.result["group_rebuild_s"] = group
        self.phase, self.attempt = RUNNING, None
        return self._reconcile(now)

    # -- failures ----------------------------------------------------------------------------
    def _note(self, text: str, now: float) -> None:
        self.error, self.error_at = text, now

    def _kill(self, reason: str) -> list[Effect]:
        self.phase = FAILED
        self.error = reason
        return [Kill(reason)]

    def _failed(self, rank: int, message: str, now: float) -> list[Effect]:
        """A rank reported that its part of the current phase failed."""
        a = self.attempt
        assert a is not None
        text = f"rank {rank}: {message}"
        if self.phase == AGREEING:
            return self._withdraw(now, text)
        if self.phase in (PARKING, COMMITTING) and not a.parked_in_ram:
            self._note(f"park failed, job keeps running: {text}", now)
            self.desired = ("running", None)
            return self._resume(now)
        if self.phase in (PARKING, COMMITTING):    # a spill failed: the RAM park stands
            self._note(f"spill to disk failed, job stays parked in RAM: {text}", now)
            self.desired = ("paused", "ram")
            self._enter(PARKED, now)
            return self._to_all(m.Release(epoch=a.epoch))
        if self.phase == UNPARKING:
            self._note(f"resume failed, job stays parked: {text}", now)
            self.desired = ("paused", "ram")
            self._enter(PARKED, now)
            return self._to_all(m.Release(epoch=a.epoch))
        return self._kill(f"{text} while {self.phase}")

    def _lose(self, rank: int, now: float, why: str) -> list[Effect]:
        if self.phase == AGREEING:
            return self._withdraw(now, why)
        if self.phase in (RUNNING, FAILED, CHECKPOINTED):
            return []       # failed: the job is being ended already, with its first reason;
                            # checkpointed: it is done with, its exit is the launcher's (a worker
                            # the launcher restarts and that attaches again must not undo that)
        if self.phase == COMMITTING and rank != 0:
            return []       # its part is durable; rank 0 still commits the whole checkpoint
        if self.phase == REGROUPING and self.attempt is not None and rank in self.attempt.answered:
            return []       # it is in the new group and training again: its exit is the launcher's business
        return self._kill(f"{why} while the job was {self.phase}: its peers cannot go on without it")


_HANDLERS = {
    (AGREEING, "mark"): Coordinator._on_mark,
    (AGREEING, "hold"): Coordinator._on_hold,
    (AGREEING, "ready"): Coordinator._on_ready,
    (PARKING, "paused"): Coordinator._on_paused,
    (PARKING, "part"): Coordinator._on_part,
    (PARKED, "paused"): Coordinator._on_released,
    (COMMITTING, "committed"): Coordinator._on_committed,
    (UNPARKING, "unparked"): Coordinator._on_unparked,
    (REGROUPING, "resumed"): Coordinator._on_resumed,
}


def _slowest(answers: Any) -> Optional[float]:
    """The slowest rank's process-group seconds (`group_s`), the part of a multi-rank switch that
    the policy models apart (policy/capability.py); None when no rank had a group to move."""
    found = [a.group_s for a in answers if getattr(a, "group_s", None) is not None]
    return round(max(found), 6) if found else None
