"""Fold what the supervisors report into job records: the 'actual state' half of the loop.

Every transition here is driven by a fact in a supervisor's status file (the job parked, resumed,
exited, ...) or by a timeout the daemon owns, and is recorded with an event and its reason.
"""
from __future__ import annotations

import logging
import shutil
import signal as signals
from typing import Any, Optional

from gpuswap import processes
from gpuswap.jobs import REQUEUE_EXIT_CODE, JobState, format_size
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.freezer import ATTACH_GRACE_S, Freezer
from gpuswap.node import residue, sessions
from gpuswap.node.launcher import SPAWN_GRACE_S, Launcher, Observation
from gpuswap.node.store import JobRecord, Store
from gpuswap.protocol.status import ExitFacts, RankFact, RuntimeFacts

log = logging.getLogger("gpuswap.observe")


class Observer:
    def __init__(self, store: Store, launcher: Launcher, freezer: Freezer, bandwidths: Bandwidths,
                 pause_timeout_s: float, no_runtime: str):
        self.store, self.launcher, self.freezer, self.bandwidths = store, launcher, freezer, bandwidths
        self.pause_timeout_s, self.no_runtime = pause_timeout_s, no_runtime
        self._killing: set[int] = set()     # jobs whose orphaned processes are being killed

    def observe(self, job: JobRecord, now: float) -> None:
        if job.state == JobState.PENDING or (job.state == JobState.PAUSED and job.parked == "disk"):
            if job.cancel_requested:
                self._end(job, now, state=JobState.CANCELLED, assigned=[], parked=None, parked_bytes=0,
                          event="cancelled before it ran" if job.state == JobState.PENDING
                          else "cancelled while parked on disk")
            return
        if job.generation == 0:
            return
        obs = self.launcher.observe(job.id, job.generation)
        if obs.exit is not None:
            if job.state == JobState.RESUMING and job.mechanism != "transparent":
                # A job may restore, train and exit between two ticks (a loaded machine, a short
                # tail): its last facts still say what the resume did, so that is recorded first,
                # at the exit time, rather than lost behind "exited while resuming".
                self._resuming(job, obs.runtime, _exit_time(obs.exit, now))
                job = self.store.get(job.id) or job
            self._finished(job, obs, now)
            return
        if not obs.alive:
            if obs.spawned_at is None:
                return          # start recorded but not spawned yet; the controller spawns it
            if obs.status is None and now - obs.spawned_at < SPAWN_GRACE_S:
                return          # supervisor still starting
            self._supervisor_died(job, obs, now)
            return
        rt = obs.runtime
        self._track_usage(job, rt, now)
        if (job.state == JobState.PAUSED and job.parked == "ram" and job.desired_tier == "disk"
                and _failed_since(rt, job.pause_requested_at)):
            # The park in RAM stands, and so does whoever asked for it: a user's pause (hold)
            # waits for the user's resume; a policy spill leaves it to the policy.
            self.store.update(job.id, now, desired_tier="ram",
                              event=f"spill to disk failed, job stays parked in RAM: {rt.error}")
            return
        if job.mechanism == "transparent" and job.state == JobState.PAUSING:
            self.freezer.freezing(job, obs, now)
        elif job.mechanism == "transparent" and job.state == JobState.RESUMING:
            self.freezer.thawing(job, obs, now)
        elif job.state == JobState.PAUSING:
            self._pausing(job, rt, obs, now)
        elif job.state == JobState.RESUMING:
            self._resuming(job, rt, now)

    # -- transitions ------------------------------------------------------------------------
    def _track_usage(self, job: JobRecord, rt: RuntimeFacts, now: float) -> None:
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
        if width is not None and width != job.width:
            changes["width"] = width
        refusal = _ram_refusal(rt.ranks)
        if refusal != job.ram_refusal and (refusal is not None or rt.ranks is not None):
            changes["ram_refusal"] = refusal
        if changes:
            self.store.update(job.id, now, **changes)

    def _pausing(self, job: JobRecord, rt: RuntimeFacts, obs: Observation, now: float) -> None:
        if job.stopped:
            if obs.stopped:   # the supervisor confirms the SIGSTOP
                self.store.update(job.id, now, state=JobState.PAUSED, parked=None, desired="running",
                                  event=f"cannot park ({job.reason}): stopped with SIGSTOP; its GPU memory "
                                        "stays allocated and is not counted as freed")
            return
        if rt.state == "paused" and rt.tier == "ram":
            nbytes = int(rt.bytes or 0)
            if rt.multi_rank:
                # A multi-rank pause_s holds the wait for the common step and the group teardown,
                # and its bytes moved over several links at once: not one link's bandwidth. The
                # slowest rank's teardown is the figure it gives.
                self.bandwidths.observe_seconds("group_teardown_s", rt.group_teardown_s)
            else:
                self.bandwidths.observe("ram_park_bps", nbytes, rt.pause_s)
            # What the park could not free (its CUDA context, ...), read from NVML now: the runtime
            # reported the park only once it was done. Kept on the job, and reserved by the policy.
            kept = residue.measure(obs.job_pid, self.freezer.gpus, job.assigned)
            stays = f"; {residue.text(kept)} (CUDA context and memory not attached)" if kept else ""
            self.store.update(
                job.id, now, state=JobState.PAUSED, parked="ram", parked_bytes=nbytes,
                home_gpus=job.assigned, assigned=[], step=rt.step, residue=kept,
                event=f"parked in RAM: {format_size(nbytes)} freed from the GPU in {rt.pause_s or 0:.2f} s"
                      + stays,
            )
            return
        if _failed_since(rt, job.pause_requested_at):
            err, lead = str(rt.error), "park failed, job keeps running: "
            self.store.update(job.id, now, state=JobState.RUNNING, desired="running", desired_tier=None,
                              hold=False, event=err if err.startswith(lead) else lead + err)  # multi-rank: said once
            return
        if rt.multi_rank and rt.phase not in (None, "running", "agreeing"):
            # Every rank reached the common step and the park is under way: the job is no longer
            # running as it was (groups torn down), and the supervisor's coordinator bounds each
            # phase by the same timeout, ending the job with the reason (runtime/ranktable.py).
            return
        asked_for = now - (job.pause_requested_at or now)
        never_attached = not rt.attached and now - (job.last_start or now) > ATTACH_GRACE_S
        if asked_for <= self.pause_timeout_s and not never_attached:
            return
        # From here on the job is not asked to pause again for the rest of this launch (a later
        # safepoint or hello proves nothing about the next pause); the flag is per record and
        # nothing clears it, so the promise in the event below holds.
        why = ("no gpuswap runtime attached" if not rt.attached
               else f"no safepoint reached within {self.pause_timeout_s:g} s")
        multi = rt.multi_rank
        if multi and rt.not_pausable:
            why = str(rt.not_pausable)          # "1 of 2 ranks attached", "rank 1 finished training"
        if self.no_runtime == "sigstop" and not multi:   # a multi-rank job's ranks are not in its session
            self.store.update(job.id, now, stopped=True, no_runtime=True, desired="running", reason=why)
        else:
            self.store.update(job.id, now, state=JobState.RUNNING, no_runtime=True, hold=False,
                              desired="running", desired_tier=None,
                              event=f"cannot park ({why}): left running; it will not be preempted")

    def _resuming(self, job: JobRecord, rt: RuntimeFacts, now: float) -> None:
        if job.parked == "ram" and rt.state == "running":
            if rt.multi_rank:     # as at the park: the group's rebuild, not a bandwidth
                self.bandwidths.observe_seconds("group_rebuild_s", rt.group_rebuild_s)
            else:
                self.bandwidths.observe("ram_resume_bps", job.parked_bytes, rt.resume_s)
            self.store.update(job.id, now, state=JobState.RUNNING, parked=None, parked_bytes=0, home_gpus=[],
                              last_start=now,
                              event=f"resumed from RAM in {rt.resume_s or 0:.2f} s")
        elif job.parked == "disk" and rt.attached:
            step = rt.restored_step
            nbytes, seconds = int(rt.restored_bytes or 0), rt.restore_s
            # The runtime timed its restore (read, verify, load, copy in): the disk tier's real
            # resume bandwidth, as a RAM resume's timing is the RAM tier's.
            self.bandwidths.observe("disk_read_bps", nbytes, seconds)
            read = f" ({format_size(nbytes)} read in {seconds:.2f} s)" if nbytes and seconds is not None else ""
            note = rt.restore_note
            if step is None and note:   # checkpoints were all bad; the job's env asked for a restart
                event = str(note)
            elif step is None:
                event = "restarted from step 0: its disk checkpoint was gone"
            else:
                event = f"restarted from its disk checkpoint at step {step}{read}" + (f"; {note}" if note else "")
            self.store.update(job.id, now, state=JobState.RUNNING, parked=None, parked_bytes=0, last_start=now,
                              event=event)

    def _supervisor_died(self, job: JobRecord, obs: Observation, now: float) -> None:
        """Nobody will reap or control the job's processes any more: kill its whole session, and
        end the job (freeing its GPUs and RAM) only once none of its processes is left."""
        pid = obs.job_pid
        # A multi-rank job's ranks lead sessions of their own (torchrun): killed by pid and start time.
        ranks = obs.rank_pids
        if pid is not None and pid > 1:
            if sessions.kill(pid, obs.job_start_ticks) + processes.kill_pids(ranks):
                if job.id not in self._killing:
                    self._killing.add(job.id)
                    log.warning("job %d: its supervisor died; killing the processes of its session %d",
                                job.id, pid)
                return      # confirmed gone at a later tick, before anything else gets its GPUs
            why = "its supervisor died without recording an exit status; its processes were killed"
        else:
            why = "its supervisor died before starting the job"
        self._killing.discard(job.id)
        self._end(job, now, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, event=why)

    def _end(self, job: JobRecord, now: float, **changes: Any) -> None:
        """Record a terminal state. A completed or cancelled job's checkpoints are dropped (nothing
        will resume them and nobody asked to keep them); a failed job's stay in jobs/ID/ckpt, its
        owner's to recover (docs/runtime.md)."""
        self.store.update(job.id, now, end_time=now, **changes)
        if changes.get("state") in (JobState.COMPLETED, JobState.CANCELLED):
            shutil.rmtree(self.launcher.ckpt_dir(job.id), ignore_errors=True)

    def _finished(self, job: JobRecord, obs: Observation, now: float) -> None:
        ex, rt = obs.exit or ExitFacts(), obs.runtime
        # When it ended, not when we noticed: a job that ended while the daemon was down is seen
        # only after the restart, but its supervisor wrote the exit time in status.json.
        now = _exit_time(ex, now)
        code, sig = ex.code, ex.signal
        common: dict[str, Any] = dict(assigned=[], stopped=False, desired="running", desired_tier=None)
        # A multi-rank job's launcher turns a rank's 75 into its own 1 (torchrun) or a kill
        # (Lightning): there the committed manifest alone says "checkpointed" (design section 4).
        multi = rt.multi_rank
        if ((code == REQUEUE_EXIT_CODE or multi) and rt.state == "checkpointed"
                and not job.cancel_requested and not ex.error):
            nbytes = int(rt.bytes or 0)
            self.bandwidths.observe("disk_write_bps", nbytes, rt.pause_s)
            if multi and job.ranks:     # each rank's part is on disk; nothing of it on a GPU
                common["ranks"] = [dict(r, state="written", connected=False, device_bytes=0) for r in job.ranks]
            self.store.update(
                job.id, now, state=JobState.PAUSED, parked="disk", parked_bytes=nbytes, home_gpus=[],
                step=rt.step, mechanism="cooperative", **common,
                event=f"parked to disk: checkpoint of {format_size(nbytes)} at step {rt.step} "
                      f"written in {rt.pause_s or 0:.2f} s; requeued"
                      + (f" ({rt.ckpt_note})" if rt.ckpt_note else ""))
            return
        common.update(parked=None, parked_bytes=0, home_gpus=[], exit_code=code, signal=sig)
        if rt.restore_failed and not job.cancel_requested:
            # No usable checkpoint: the job refused to start over. Its checkpoints are kept (not
            # `_end`): they are the evidence, and perhaps repairable.
            self.store.update(job.id, now, end_time=now, state=JobState.FAILED,
                              event=f"{rt.restore_failed} ({_exit_text(code, sig)})", **common)
            return
        where = f" while {job.state.value.lower()}" if job.state != JobState.RUNNING else ""
        if ex.error:
            self._end(job, now, state=JobState.FAILED, event=ex.error, **common)
        elif job.abort_reason:
            self._end(job, now, state=JobState.FAILED, event=f"{job.abort_reason} ({_exit_text(code, sig)})", **common)
        elif job.cancel_requested:
            self._end(job, now, state=JobState.CANCELLED, event=f"{_exit_text(code, sig)} after a cancel request",
                      **common)
        elif code == 0:
            self._end(job, now, state=JobState.COMPLETED, event=f"exited with code 0{where}", **common)
        else:
            self._end(job, now, state=JobState.FAILED, event=_exit_text(code, sig) + where, **common)


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

