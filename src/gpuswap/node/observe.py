"""Fold what the supervisors report into job records: the 'actual state' half of the loop.

Every transition here is driven by a fact in a supervisor's status file (the job parked, resumed,
exited, ...) or by a timeout the daemon owns, and is recorded with an event and its reason.

`decide` is a pure function of (record, facts, now): it returns the transitions to make, as data
(node/transition.py), and the controller applies them. A transparently parked job's driver steps
are the freezer's (`Verdict.driver`), which the controller runs after these.
"""
from __future__ import annotations

import dataclasses
import signal as signals
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional

from gpuswap.jobs import REQUEUE_EXIT_CODE, JobState, format_size
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node import residue
from gpuswap.node.launcher import SPAWN_GRACE_S, Observation
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import KillProcesses, RemoveCheckpoints, Sample, Transition
from gpuswap.protocol.status import ExitFacts, RankFact, RuntimeFacts

P, R, PG, PD, RS = JobState.PENDING, JobState.RUNNING, JobState.PAUSING, JobState.PAUSED, JobState.RESUMING


@dataclass(frozen=True)
class Rules:
    """The daemon's settings the observer applies (node/settings.py checks them)."""
    pause_timeout_s: float       # no safepoint within this long after a pause request: fall back
    no_runtime: str              # the fallback: "wait" (keep running) or "sigstop"
    attach_grace_s: float        # no runtime attached this long after a start: it has none


@dataclass(frozen=True)
class Facts:
    """What was read about a job this tick, beside its record."""
    obs: Optional[Observation]                    # its supervisor's status; None: not read (no process)
    residue: Mapping[int, int] = field(default_factory=dict)  # NVML after a RAM park (`wants_residue`)
    orphans: int = 0             # processes left of a job whose supervisor died (sessions.alive)
    # A RUNNING job's freeze record is kept beside it (node/transparent.py FreezeRecord): a freeze
    # given up on may have left its CUDA processes locked or checkpointed in the driver.
    freeze_record: bool = False


@dataclass(frozen=True)
class Verdict:
    transitions: tuple[Transition, ...] = ()
    driver: Optional[Literal["freezing", "thawing", "undoing"]] = None   # then the freezer goes on from here


def reads_status(job: JobRecord) -> bool:
    """Whether the job has a supervisor to read this tick (a pending or disk-parked job has none)."""
    return not (job.state == P or (job.state == PD and job.parked == "disk")) and job.generation != 0


def wants_residue(job: JobRecord, obs: Observation) -> bool:
    """Whether `decide` will record a RAM park now, and so needs what it left on the GPUs (NVML)."""
    rt = obs.runtime
    return (obs.exit is None and obs.alive and job.state == PG and job.mechanism != "transparent"
            and not job.stopped and rt.state == "paused" and rt.tier == "ram")


def decide(job: JobRecord, facts: Facts, now: float, rules: Rules) -> Verdict:
    if job.state == P or (job.state == PD and job.parked == "disk"):
        if job.cancel_requested:
            return Verdict((_end(job, now, state=JobState.CANCELLED, assigned=[], parked=None, parked_bytes=0,
                                 event=NewEvent(K.CANCELLED, "cancelled before it ran" if job.state == P
                                                else "cancelled while parked on disk", initiator="user")),))
        return Verdict()
    obs = facts.obs
    if job.generation == 0 or obs is None:
        return Verdict()
    if obs.exit is not None:
        out: list[Transition] = []
        if job.state == RS and job.mechanism != "transparent":
            # A job may restore, train and exit between two ticks (a loaded machine, a short
            # tail): its last facts still say what the resume did, so that is recorded first,
            # at the exit time, rather than lost behind "exited while resuming".
            first = _resuming(job, obs.runtime, _exit_time(obs.exit, now))
            if first is not None:
                out.append(first)
                job = _after(job, first)
        out.append(_finished(job, obs, now))
        return Verdict(tuple(out))
    if not obs.alive:
        if obs.spawned_at is None:
            return Verdict()     # start recorded but not spawned yet; the controller spawns it
        if obs.status is None and now - obs.spawned_at < SPAWN_GRACE_S:
            return Verdict()     # supervisor still starting
        return Verdict((_supervisor_died(job, obs, facts.orphans, now),))
    rt = obs.runtime
    out = [t for t in (_track_usage(job, rt, now),) if t is not None]
    if job.state == PD and job.parked == "ram" and job.desired_tier == "disk" and _failed_since(rt, job.pause_requested_at):
        # The park in RAM stands, and so does whoever asked for it: a user's pause (hold)
        # waits for the user's resume; a policy spill leaves it to the policy.
        # A user's spill is answered: the hold stays, to RAM (else the controller would ask again).
        undo = dict(hold_tier="ram") if job.hold_tier == "disk" else {}
        out.append(Transition(now, dict(desired_tier="ram", **undo), NewEvent(
            K.SPILL_FAILED, f"spill to disk failed, job stays parked in RAM: {rt.error}")))
        return Verdict(tuple(out))
    if job.mechanism == "transparent" and job.state in (PG, RS):
        return Verdict(tuple(out), "freezing" if job.state == PG else "thawing")
    if job.state == R and facts.freeze_record:
        # Desired and recorded running, but the driver may hold it: the freezer puts it back.
        return Verdict(tuple(out), "undoing")
    step = (_pausing(job, rt, obs, facts.residue, now, rules) if job.state == PG
            else _resuming(job, rt, now) if job.state == RS else None)
    return Verdict(tuple(out) + ((step,) if step is not None else ()))


def _after(job: JobRecord, t: Transition) -> JobRecord:
    """The record as `t` leaves it (what the store would read back)."""
    changes = {k: v for k, v in t.changes.items() if k in {f.name for f in dataclasses.fields(JobRecord)}}
    if t.event is not None and "reason" not in changes:     # as Store.update: the event's text, unless set
        changes["reason"] = t.event.text
    return dataclasses.replace(job, **changes)


def _track_usage(job: JobRecord, rt: RuntimeFacts, now: float) -> Optional[Transition]:
    # `no_runtime` is never cleared here: once a pause timed out the job was told "it will not
    # be preempted", and a runtime that is attached but slow between safepoints would
    # otherwise be asked again at once, time out again, and loop. See _pausing.
    changes: dict[str, Any] = {}
    if rt.attached and not job.attached:
        changes["attached"] = True
    dev = int(rt.device_bytes or 0)
    if rt.state == "running" and dev and dev != job.device_bytes:
        changes["device_bytes"] = dev
    if rt.step is not None and rt.step != job.step:
        changes["step"] = rt.step
    if rt.ranks is not None:       # a multi-rank job: its ranks and their states, for `show` and `ls`
        ranks = [{k: getattr(r, k) for k in ("rank", "pid", "state", "connected", "device_bytes")}
                 for r in rt.ranks]
        if ranks != job.ranks:
            changes["ranks"] = ranks
    width = rt.world_size     # a multi-rank runtime's ranks (protocol/status.py bounds it)
    if isinstance(width, int) and not isinstance(width, bool) and 1 <= width <= 1024 and width != job.width:
        changes["width"] = width
    refusal = _ram_refusal(rt.ranks)
    if refusal != job.ram_refusal and (refusal is not None or rt.ranks is not None):
        changes["ram_refusal"] = refusal
    return Transition(now, changes) if changes else None


def _pausing(job: JobRecord, rt: RuntimeFacts, obs: Observation, kept: Mapping[int, int], now: float,
             rules: Rules) -> Optional[Transition]:
    if job.stopped:
        if obs.stopped:   # the supervisor confirms the SIGSTOP
            return Transition(now, dict(state=PD, parked=None, desired="running"), NewEvent(
                K.SIGSTOPPED, f"cannot park ({job.reason}): stopped with SIGSTOP; its GPU memory stays allocated "
                              "and is not counted as freed"))
        return None
    multi = rt.multi_rank
    if rt.state == "paused" and rt.tier == "ram":
        nbytes = int(rt.bytes or 0)
        # A multi-rank pause_s holds the wait for the common step and the group teardown, and its
        # bytes moved over several links at once: not one link's bandwidth. The slowest rank's
        # teardown is the figure it gives.
        sample = (Sample("group_teardown_s", None, rt.group_teardown_s) if multi
                  else Sample("ram_park_bps", nbytes, rt.pause_s))
        # What the park could not free (its CUDA context, ...), read from NVML after the runtime
        # reported the park done (`facts.residue`). Kept on the job, and reserved by the policy.
        kept = dict(kept)
        stays = f"; {residue.text(kept)} (CUDA context and memory not attached)" if kept else ""
        return Transition(now, dict(state=PD, parked="ram", parked_bytes=nbytes, home_gpus=job.assigned, assigned=[],
                                    step=rt.step, residue=kept), NewEvent(
            K.PARKED_RAM, f"parked in RAM: {format_size(nbytes)} freed from the GPU in {rt.pause_s or 0:.2f} s"
                          + stays), (sample,))
    if _failed_since(rt, job.pause_requested_at):
        err, lead = str(rt.error), "park failed, job keeps running: "
        return Transition(now, dict(state=R, desired="running", desired_tier=None, hold=False), NewEvent(
            K.PARK_FAILED, err if err.startswith(lead) else lead + err,   # multi-rank: the lead said once
            tier=job.desired_tier, mechanism=job.mechanism))
    if multi and rt.phase not in (None, "running", "agreeing"):
        # Every rank reached the common step and the park is under way: the job is no longer
        # running as it was (groups torn down), and the supervisor's coordinator bounds each
        # phase by the same timeout, ending the job with the reason (runtime/ranktable.py).
        return None
    # The timeout runs from when the request reached the supervisor (desired.json asks for the
    # pause), not from when it was recorded: a request the daemon could not write (a full disk)
    # blamed the job for reaching no safepoint and marked it unparkable for good.
    delivered = obs.pause_delivered_at
    asked_for = 0.0 if delivered is None else now - max(job.pause_requested_at or now, delivered)
    never_attached = not rt.attached and now - (job.last_start or now) > rules.attach_grace_s
    if asked_for <= rules.pause_timeout_s and not never_attached:
        return None
    # From here on the job is not asked to pause again for the rest of this launch (a later
    # safepoint or hello proves nothing about the next pause); the flag is per record and
    # nothing clears it, so the promise in the event below holds.
    why = ("no gpuswap runtime attached" if not rt.attached
           else f"no safepoint reached within {rules.pause_timeout_s:g} s")
    if multi and rt.not_pausable:
        why = str(rt.not_pausable)          # "1 of 2 ranks attached", "rank 1 finished training"
    if rules.no_runtime == "sigstop" and not multi:   # a multi-rank job's ranks are not in its session
        return Transition(now, dict(stopped=True, no_runtime=True, desired="running", reason=why))
    return Transition(now, dict(state=R, no_runtime=True, hold=False, desired="running", desired_tier=None), NewEvent(
        K.CANNOT_PARK, f"cannot park ({why}): left running; it will not be preempted",
        tier=job.desired_tier, mechanism=job.mechanism))


def _resuming(job: JobRecord, rt: RuntimeFacts, now: float) -> Optional[Transition]:
    if job.parked == "ram" and rt.state == "running":
        sample = (Sample("group_rebuild_s", None, rt.group_rebuild_s) if rt.multi_rank
                  else Sample("ram_resume_bps", job.parked_bytes, rt.resume_s))   # as at the park
        return Transition(now, dict(state=R, parked=None, parked_bytes=0, home_gpus=[], last_start=now), NewEvent(
            K.RESUMED_RAM, f"resumed from RAM in {rt.resume_s or 0:.2f} s"), (sample,))
    if job.parked == "disk" and rt.attached:
        step = rt.restored_step
        nbytes, seconds = int(rt.restored_bytes or 0), rt.restore_s
        read = f" ({format_size(nbytes)} read in {seconds:.2f} s)" if nbytes and seconds is not None else ""
        note = rt.restore_note
        if step is None and note:   # checkpoints were all bad; the job's env asked for a restart
            text = str(note)
        elif step is None:
            text = "restarted from step 0: its disk checkpoint was gone"
        else:
            text = f"restarted from its disk checkpoint at step {step}{read}" + (f"; {note}" if note else "")
        # The runtime timed its restore (read, verify, load, copy in): the disk tier's real
        # resume bandwidth, as a RAM resume's timing is the RAM tier's.
        return Transition(now, dict(state=R, parked=None, parked_bytes=0, last_start=now),
                          NewEvent(K.RESTARTED_DISK, text), (Sample("disk_read_bps", nbytes, seconds),))
    return None


def _supervisor_died(job: JobRecord, obs: Observation, orphans: int, now: float) -> Transition:
    """Nobody will reap or control the job's processes any more: kill its whole session, and
    end the job (freeing its GPUs and RAM) only once none of its processes is left."""
    pid = obs.job_pid
    if pid is not None and pid > 1:
        if orphans:
            # A multi-rank job's ranks lead sessions of their own (torchrun): killed by pid and start time.
            kill = KillProcesses(pid, obs.job_start_ticks, job.uid, tuple(obs.rank_pids))
            return Transition(now, effects=(kill,))
            # confirmed gone at a later tick, before anything else gets its GPUs
        why = "its supervisor died without recording an exit status; its processes were killed"
    else:
        why = "its supervisor died before starting the job"
    # An ended job keeps nothing of a park or a stop (lifecycle.CARRIES): a RAM-parked or SIGSTOPped
    # job's supervisor can die too.
    return _end(job, now, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, home_gpus=[],
                stopped=False, event=NewEvent(K.FAILED, why))


def node_lost(job: JobRecord, why: str, now: float) -> Transition:
    """A pool's node lost for good (Pool.lost): nothing of the job can be observed or controlled
    any more. It ends FAILED with its GPUs and park released; how it exited is not known, so no
    exit code or signal is recorded. A disk checkpoint stays on that node's disk."""
    where = (f"; its disk checkpoint (step {job.step}) stays on that node" if job.parked == "disk" and job.step
             is not None else "; its disk checkpoint stays on that node" if job.parked == "disk" else "")
    return _end(job, now, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, home_gpus=[],
                stopped=False, desired="running", desired_tier=None,
                event=NewEvent(K.FAILED, f"{why}; how the job ended there is not known{where}"))


def node_lost_requeued(job: JobRecord, why: str, step: int, nbytes: int, now: float) -> Transition:
    """A pool's node lost for good, but the job's last disk checkpoint (at `step`) is on storage
    other nodes reach: it is parked on disk there again, as if it had been parked at that step,
    and resumes on one of them (the work since that step is redone; what it did there is lost).
    A multi-rank job's checkpoint is every rank's part of that step (node/lastckpt.py): its ranks
    are recorded as a park to disk leaves them, their parts written, none connected."""
    changes: dict[str, Any] = dict(state=PD, parked="disk", parked_bytes=nbytes, home_gpus=[], step=step,
                                   mechanism="cooperative", assigned=[], stopped=False, desired="running",
                                   desired_tier=None)
    if job.ranks:
        changes["ranks"] = [dict(r, state="written", connected=False, device_bytes=0) for r in job.ranks]
    parts = f", {job.width} parts, one per rank" if job.width > 1 else ""
    return Transition(now, changes, NewEvent(
        K.REQUEUED, f"{why}; requeued from its last disk checkpoint (step {step}, {format_size(nbytes)}{parts}), "
                    "on storage other nodes reach"))


def _end(job: JobRecord, now: float, event: NewEvent, **changes: Any) -> Transition:
    """Record a terminal state. A completed or cancelled job's checkpoints are dropped (nothing
    will resume them and nobody asked to keep them); a failed job's stay in jobs/ID/ckpt, its
    owner's to recover (docs/runtime.md)."""
    drop = changes.get("state") in (JobState.COMPLETED, JobState.CANCELLED)
    return Transition(now, dict(end_time=now, **changes), event, (RemoveCheckpoints(job.id),) if drop else ())


def _finished(job: JobRecord, obs: Observation, now: float) -> Transition:
    ex, rt = obs.exit or ExitFacts(), obs.runtime
    # When it ended, not when we noticed: a job that ended while the daemon was down is seen
    # only after the restart, but its supervisor wrote the exit time in status.json.
    now = _exit_time(ex, now)
    code, sig = ex.code, ex.signal
    common: dict[str, Any] = dict(assigned=[], stopped=False, desired="running", desired_tier=None)
    # A multi-rank job's launcher turns a rank's 75 into its own 1 (torchrun) or a kill
    # (Lightning): there the committed manifest alone says "checkpointed" (design section 4).
    # A single process says "checkpointed" only once its checkpoint is committed, just before it
    # exits 75; what runs while it unwinds (a framework's teardown, a `finally:`) may still fail
    # and exit otherwise, and the checkpoint is as good: requeued all the same, the code noted.
    # Exit 0 is the job's own word that it finished (a script that caught the SystemExit and
    # trained on to its end): completed, as before.
    multi = rt.multi_rank
    finished = code == 0 and not sig and not multi
    if (rt.state == "checkpointed" and not finished and not job.cancel_requested and not ex.error):
        if code != REQUEUE_EXIT_CODE and not multi:
            unwound = f"{_exit_text(code, sig)} while unwinding, after its checkpoint"
            rt_note = f"{rt.ckpt_note}; {unwound}" if rt.ckpt_note else unwound
        else:
            rt_note = rt.ckpt_note
        nbytes = int(rt.bytes or 0)
        if multi and job.ranks:     # each rank's part is on disk; nothing of it on a GPU
            common["ranks"] = [dict(r, state="written", connected=False, device_bytes=0) for r in job.ranks]
        return Transition(now, dict(state=PD, parked="disk", parked_bytes=nbytes, home_gpus=[], step=rt.step,
                                    mechanism="cooperative", **common), NewEvent(
            K.SPILLED if job.state == PD else K.PARKED_DISK,
            f"parked to disk: checkpoint of {format_size(nbytes)} at step {rt.step} written in "
            f"{rt.pause_s or 0:.2f} s; requeued" + (f" ({rt_note})" if rt_note else "")),
            (Sample("disk_write_bps", nbytes, rt.pause_s),))
    common.update(parked=None, parked_bytes=0, home_gpus=[], exit_code=code, signal=sig)
    if rt.restore_failed and not job.cancel_requested:
        # No usable checkpoint: the job refused to start over. Its checkpoints are kept (not
        # `_end`'s drop): they are the evidence, and perhaps repairable.
        return Transition(now, dict(end_time=now, state=JobState.FAILED, **common),
                          NewEvent(K.FAILED, f"{rt.restore_failed} ({_exit_text(code, sig)})"))
    where = f" while {job.state.value.lower()}" if job.state != R else ""
    if ex.error:
        return _end(job, now, NewEvent(K.FAILED, ex.error), state=JobState.FAILED, **common)
    if job.abort_reason:
        return _end(job, now, NewEvent(K.FAILED, f"{job.abort_reason} ({_exit_text(code, sig)})"),
                    state=JobState.FAILED, **common)
    if job.cancel_requested:
        return _end(job, now, NewEvent(K.CANCELLED, f"{_exit_text(code, sig)} after a cancel request",
                                       initiator="user"), state=JobState.CANCELLED, **common)
    if code == 0:
        return _end(job, now, NewEvent(K.COMPLETED, f"exited with code 0{where}"), state=JobState.COMPLETED, **common)
    return _end(job, now, NewEvent(K.FAILED, _exit_text(code, sig) + where), state=JobState.FAILED, **common)


def _exit_time(ex: ExitFacts, now: float) -> float:
    """The supervisor's recorded exit time, if it is usable (never later than now)."""
    if ex.time is None:
        return now
    when = float(ex.time)
    return min(when, now) if when > 0 else now


def _ram_refusal(ranks: Optional[tuple[RankFact, ...]]) -> Optional[str]:
    """Why the job's ranks cannot rebuild their group (each rank's `ram_refusal` in the runtime's
    `ranks` facts, runtime/agreement.py), as one line; None when none refuses."""
    if ranks is None:
        return None
    out = [f"rank {r.rank}: {r.ram_refusal[:200]}" for r in ranks if r.ram_refusal]
    return "; ".join(out)[:1000] or None


def _failed_since(rt: RuntimeFacts, asked_at: Any) -> bool:
    """The runtime reported an error for a request made at `asked_at` (not an older one)."""
    return bool(rt.error) and float(rt.error_at or 0) >= float(asked_at or 0)


def _exit_text(code: Any, sig: Any) -> str:
    if sig:
        try:
            name = signals.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}"     # the exit code (128+N) is the record's, shown beside the state
    return f"exited with code {code}"
