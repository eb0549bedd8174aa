"""Job-level flow of transparent parking: which mechanism parks a job, and the freeze/thaw moves
that turn the driver's state into job states and events.

The job's CUDA process (any in its process tree) and its footprint are taken from NVML once,
before the first lock, and kept in the run directory (FreezeRecord): after
a checkpoint NVML lists them no more, so every later step, the thaw and a restarted daemon use
that record and ask the driver, never NVML, where each process is. The driver is never asked
about a stopped process: the tree is stopped last on freeze and continued first on thaw.

A job whose GPU work is spread over several CUDA processes (a multi-rank runtime, or more than
one process in NVML's list) is refused before any driver call: ranks of one group share CUDA IPC
memory, which cuda-checkpoint does not checkpoint (policy/capability.py, docs/transparent.md).

Every failure ends in a defined state with its reason: a lock that times out or a driver that
refuses leaves the job RUNNING and not preempted transparently again (a process its user stopped:
until it is continued); a process that exits while frozen ends by its exit code; a failed
restore, which the driver cannot retry (NVIDIA/cuda-checkpoint#44), ends the job FAILED rather
than leaving it stuck. What a freeze given up on took is put back level-triggered (`undoing`):
the freeze's record stays beside the RUNNING job, marked, until the driver holds nothing of it,
so a daemon restarted while the user's process was stopped still unlocks it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from gpuswap.jobs import JobState, format_size
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node.cuda_ckpt import CHECKPOINTED, LOCKED, RUNNING, CheckpointDriver, CheckpointError
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.launcher import Observation
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import RemoveFile, Sample, Transition
from gpuswap.node.transparent import (CudaProcess, FreezeRecord, StateQueries, StepRunner, Unanswered,
                                      gpu_permutation, job_cuda_processes, next_freeze_step, next_thaw_step,
                                      room_for)
from gpuswap.policy.capability import (NCCL_TRANSPARENT_REFUSAL, Parkability, RuntimeKind, parkability,
                                       transparent_allowed)
from gpuswap.protocol import rundir
from gpuswap.simcuda import start_ticks

LOCK_TIMEOUT_MS = 10_000


def mechanism_for(job: JobRecord, transparent_ok: bool) -> Optional[str]:
    """How a pause of this job would be carried out, or None if it cannot be parked at all."""
    if job.pause_mode == "cooperative":
        return "cooperative"
    driver_ok = transparent_allowed(job.width, transparent_ok and not job.transparent_refused)
    if job.pause_mode == "transparent":
        return "transparent" if driver_ok else None
    if job.attached:
        return "cooperative"
    return "transparent" if driver_ok else "cooperative"   # cooperative: falls back if it never attaches


def runtime_kind(job: JobRecord) -> RuntimeKind:
    """The daemon's record in capability.py's terms (see RuntimeKind there)."""
    if job.pause_mode == "transparent":
        return "none"
    if job.pause_mode == "cooperative" or job.attached:
        return "unresponsive" if job.no_runtime else "cooperative"
    return "none" if job.no_runtime else "auto"


def job_parkability(job: JobRecord, transparent_ok: bool) -> Parkability:
    """How this job can be parked now, and why not where it cannot (capability.py decides)."""
    return parkability(job.width, runtime_kind(job), None, transparent_ok and not job.transparent_refused,
                       job.ram_refusal, transparent_refused=job.transparent_refused)


def awaiting_runtime(job: JobRecord, now: float, grace_s: float) -> bool:
    """An auto-mode job young enough that its runtime may still attach (a cooperative job spends
    its first seconds importing its framework): how it would be parked is not known yet."""
    return (job.pause_mode == "auto" and not job.attached and not job.no_runtime
            and job.last_start is not None and now - job.last_start <= grace_s)


def deferred_pause_text(tier: str, grace_s: float) -> str:
    """The event of a user's pause kept until the job's runtime attaches (the API waits for it)."""
    return (f"pause to {tier} deferred: the job's gpuswap runtime has not attached yet; it is parked at "
            f"its first safepoint, or handled as a job without a runtime if none attaches within "
            f"{grace_s:g} s of its start")


def tiers_for(job: JobRecord, transparent_ok: bool) -> frozenset[str]:
    """The tiers the policy may choose for this job now (capability.py: the transparent disk tier
    would need CRIU, which gpuswap does not drive, so driver-frozen jobs park in RAM only)."""
    return job_parkability(job, transparent_ok).tiers


class Freezer:
    """Drives the driver's steps for a transparently parked job; what they mean for the job's
    record comes back as a Transition (node/transition.py) for the controller to apply."""

    def __init__(self, driver: CheckpointDriver, gpus: GpuInventory, run_dir: Callable[[int, int], Path]):
        self.driver, self.gpus = driver, gpus
        self.run_dir = run_dir
        self.runner = StepRunner(driver)
        self.queries = StateQueries(driver)    # the loop's own questions, bounded (a stopped process never answers)
        self._timings: dict[int, dict[str, float]] = {}

    @property
    def migration(self) -> bool:
        return self.driver.capability.migration

    def _path(self, job: JobRecord) -> Path:
        return self.run_dir(job.id, job.generation) / rundir.TRANSPARENT

    def _forget(self, job: JobRecord) -> None:
        try:
            self._path(job).unlink()
        except FileNotFoundError:
            pass

    def _ready(self, job: JobRecord, obs: Observation) -> tuple[Optional[int], Optional[CheckpointError]]:
        """(job pid, error of the step that just finished); pid None while there is nothing to do
        (no process yet, or a driver call still in flight)."""
        pid = obs.job_pid
        done = self.runner.result(job.id)
        if done is not None:
            t = self._timings.setdefault(job.id, {})
            t[done.step] = t.get(done.step, 0.0) + done.seconds
        if not pid or self.runner.busy(job.id):
            return None, None
        return pid, done.error if done is not None else None

    def _run(self, job: JobRecord, step: str, pids: list[int], call: Callable[[int], None]) -> None:
        """One step for each of `pids`, in order, off the control loop; the first error stops it."""
        def all_of() -> None:
            for p in pids:
                call(p)
        self.runner.start(job.id, step, all_of)

    # -- freeze -----------------------------------------------------------------------------
    def freezing(self, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        pid, error = self._ready(job, obs)
        rec = FreezeRecord.load(self._path(job))
        if rec is not None and rec.refused is not None:     # given up before a restart: record it again
            return self._refuse(job, now, rec.refused, rec, rec.retry)
        if error is not None and pid:
            return self._refuse(job, now, error, rec)
        if not pid:
            return None
        if obs.stopped:
            # Stopped only once every process was checkpointed, which was recorded first: the
            # driver is not asked (a stopped process cannot answer it).
            if rec is not None and rec.checkpointed:
                return self._frozen(job, now, rec)
            if job.stopped:       # stopped without a record of the checkpoints: continue it, then ask
                return Transition(now, dict(stopped=False))
            return None
        if rec is None:
            procs = job_cuda_processes(pid, self.gpus)
            if not procs:
                return self._refuse(job, now, "no CUDA process found in the job's process tree (NVML lists none)", None)
            if job.width > 1 or len({p.pid for p in procs}) > 1:
                # Ranks of one group share CUDA IPC memory, which the driver does not checkpoint;
                # without a runtime saying otherwise, several CUDA processes are taken to be such
                # ranks. Refused before any driver call (docs/transparent.md).
                return self._refuse(job, now, NCCL_TRANSPARENT_REFUSAL, None)
            rec = FreezeRecord(tuple(procs))
            if job.ram_allowance is not None and rec.nbytes > job.ram_allowance:
                return Transition(now, dict(state=JobState.RUNNING, hold=False, desired_tier=None,
                                            device_bytes=rec.nbytes // max(len(job.assigned), 1)), NewEvent(
                    K.PARK_FAILED, f"not frozen: its {format_size(rec.nbytes)} would exceed the host-RAM budget "
                                   f"({format_size(job.ram_allowance)} left)", tier="ram", mechanism="transparent"))
            rec.save(self._path(job))        # before the first lock: the footprint NVML shows now
        pids = rec.pids
        if len(rec.alive()) != len(pids):
            return self._refuse(job, now, "a CUDA process of the job exited during the freeze", rec)
        try:
            states = [self.queries.state(p) for p in pids]
        except Unanswered as e:              # a process its user stopped is not frozen, for now
            return self._refuse(job, now, e, rec, retry=e.stopped)
        except CheckpointError as e:
            return self._refuse(job, now, e, rec)
        step = next_freeze_step(states)
        if step == "lock":
            self._run(job, "lock", [p for p, s in zip(pids, states) if s == RUNNING],
                      lambda p: self.driver.lock(p, LOCK_TIMEOUT_MS))
        elif step == "checkpoint":
            self._run(job, "checkpoint", [p for p, s in zip(pids, states) if s == LOCKED], self.driver.checkpoint)
        elif step == "stop":
            if not rec.checkpointed:
                FreezeRecord(rec.processes, checkpointed=True).save(self._path(job))
            if not job.stopped:
                return Transition(now, dict(stopped=True))
        else:
            return self._abort(job, now, f"the driver reports the job's CUDA state as {', '.join(states)}")
        return None

    def _frozen(self, job: JobRecord, now: float, rec: FreezeRecord) -> Transition:
        t = self._timings.pop(job.id, {})
        # A simulated driver moved nothing: its timing is no bandwidth.
        sample = () if self.driver.capability.simulated else (Sample("ram_park_bps", rec.nbytes, t.get("checkpoint")),)
        return Transition(
            now, dict(state=JobState.PAUSED, parked="ram", parked_bytes=rec.nbytes, home_gpus=job.assigned, assigned=[]),
            effects=sample,
            event=NewEvent(K.FROZEN, f"frozen transparently{_sim(self.gpus)}: {format_size(rec.nbytes)} of CUDA "
                           f"process {', '.join(map(str, rec.pids))} moved to host RAM by the driver (lock "
                           f"{t.get('lock', 0):.2f} s, checkpoint {t.get('checkpoint', 0):.2f} s), process tree stopped"))

    def _refuse(self, job: JobRecord, now: float, error: Any, rec: Optional[FreezeRecord],
                retry: bool = False) -> Transition:
        """Give up on freezing this job: keep it running, say why. What the driver took is put back
        by `undoing` (restore, unlock), keyed on the record kept here, marked: a process stopped by
        its user is answered for only once continued, maybe by a later daemon. `retry`: refused
        only because it was stopped; once put back it may be frozen again."""
        why = f"lock timed out after {LOCK_TIMEOUT_MS / 1000:.0f} s" if getattr(error, "timed_out", False) else str(error)
        if rec is not None:
            if rec.refused is None:
                FreezeRecord(rec.processes, rec.checkpointed, why, retry).save(self._path(job))
        else:
            self._forget(job)
        self._timings.pop(job.id, None)
        then = ("frozen transparently again only once it is continued" if retry
                else "not parked transparently again")
        return Transition(now, dict(state=JobState.RUNNING, stopped=False, hold=False, transparent_refused=why,
                                    desired="running", desired_tier=None),
                          event=NewEvent(K.CANNOT_FREEZE, f"cannot freeze transparently ({why}): left running; {then}",
                                         tier="ram"))

    # -- undo -------------------------------------------------------------------------------
    def undoing(self, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        """A RUNNING job whose freeze was given up on: put back what the driver holds of its CUDA
        processes (restore a checkpointed one, then unlock), one step per tick off the loop, as
        thawing does. Keyed on the freeze's record beside the job (controller: Facts.freeze_record),
        so a daemon restarted meanwhile still does it, and no other running job costs a driver
        call. A stopped process is not asked (StateQueries): the job waits until it is continued."""
        pid, error = self._ready(job, obs)
        rec = FreezeRecord.load(self._path(job))
        if rec is None or rec.refused is None:
            # A record without the mark beside a RUNNING job: its freeze or thaw ended, recorded,
            # and the file was left (the thaw forgets it first): nothing to undo.
            self._forget(job)
            return None
        if error is not None:
            self._forget(job)
            self._timings.pop(job.id, None)
            return self._abort(job, now, f"could not put back what the driver held after the freeze was given up "
                                         f"({error}); the driver cannot retry a failed restore")
        if not pid:
            return None
        alive, states = rec.alive(), []
        for p in alive:
            try:
                states.append(self.queries.state(p))
            except Unanswered:
                return None       # stopped by its user: the refusal said it waits for the SIGCONT
            except CheckpointError as e:
                if not e.no_cuda_state:     # unknown: it may still be locked; never forget it on this
                    return self._unanswered(job, now, p, e)
                states.append(RUNNING)      # no CUDA state (left): the driver holds nothing of it
        step = next_thaw_step(states) if states else "done"
        if step == "restore":
            short = room_for(self.gpus, rec.bytes_by_gpu())
            if short:
                if not job.reason.startswith("waiting for room"):
                    return Transition(now, event=NewEvent(K.RESTORE_DEFERRED, f"waiting for room before putting "
                                                                              f"back a freeze given up on: {short}"))
                return None
            self._run(job, "restore", [p for p, s in zip(alive, states) if s == CHECKPOINTED],
                      lambda p: self.driver.restore(p, None))
        elif step == "unlock":
            self._run(job, "unlock", [p for p, s in zip(alive, states) if s == LOCKED], self.driver.unlock)
        elif step == "done":
            t = self._put_back(job, now, rec, self._timings.pop(job.id, {}))
            if t is None:
                self._forget(job)           # nothing to record
                return None
            # The record goes once the event is stored (an effect): were the store to fail, the
            # next tick would find the record and put back again, rather than the refusal stay.
            return replace(t, effects=t.effects + (RemoveFile(str(self._path(job))),))
        else:
            self._forget(job)
            return self._abort(job, now, f"the driver reports the job's CUDA state as {', '.join(states)}")
        return None

    def _unanswered(self, job: JobRecord, now: float, pid: int, e: CheckpointError) -> Optional[Transition]:
        """The driver's state question failed with an error that does not say the process holds
        nothing: asked again each tick, said once (it may be locked: forgetting would leave it so)."""
        if job.reason.startswith("waiting to put back"):
            return None
        return Transition(now, event=NewEvent(K.RESTORE_DEFERRED, f"waiting to put back a freeze given up on: "
                                                                  f"the driver's state of CUDA process {pid} "
                                                                  f"failed ({e.code}); asked again"))

    def _put_back(self, job: JobRecord, now: float, rec: FreezeRecord, t: dict[str, float]) -> Optional[Transition]:
        """The event of an undo: what was put back and why; and the refusal lifted if it was the stop."""
        done = [step for step in ("restore", "unlock") if step in t]
        again = rec.retry and job.transparent_refused == rec.refused
        if not done and not again:
            return None
        verbs = {"restore": "restored", "unlock": "unlocked"}
        what = (f"{' and '.join(verbs[d] for d in done)} CUDA process {', '.join(map(str, rec.pids))}{_sim(self.gpus)} "
                f"({', '.join(f'{d} {t[d]:.2f} s' for d in done)})" if done else "the driver held nothing of it")
        lead = "put back after" if done else "after"
        return Transition(now, dict(transparent_refused=None) if again else {}, NewEvent(
            K.PUT_BACK, f"{lead} a freeze given up on ({rec.refused}): {what}"
                        + ("; it can be frozen transparently again" if again else "")))

    # -- thaw -------------------------------------------------------------------------------
    def thawing(self, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        pid, error = self._ready(job, obs)
        if error is not None:
            return self._abort(job, now, f"thaw failed ({error}); the driver cannot retry a failed restore")
        if not pid:
            return None
        if job.stopped or obs.stopped:     # SIGCONT first: the driver is never asked about a stopped process
            return Transition(now, dict(stopped=False)) if job.stopped else None
        try:
            rec = FreezeRecord.load(self._path(job)) or self._rediscover(pid, job)
        except Unanswered as e:
            if not job.reason.startswith("waiting to restore"):
                return Transition(now, event=NewEvent(K.RESTORE_DEFERRED, f"waiting to restore: {e.code}"))
            return None
        if rec is None:
            return self._abort(job, now, "thaw failed: no CUDA process of the job is known to the driver")
        pids = rec.pids
        if len(rec.alive()) != len(pids):
            return self._abort(job, now, "thaw failed: a CUDA process of the job exited while it was frozen")
        try:
            states = [self.queries.state(p) for p in pids]
        except Unanswered as e:             # stopped by its user since our SIGCONT: wait, say why
            if not job.reason.startswith("waiting to restore"):
                return Transition(now, event=NewEvent(K.RESTORE_DEFERRED, f"waiting to restore: {e.code}"))
            return None
        except CheckpointError as e:
            return self._abort(job, now, f"thaw failed ({e})")
        step = next_thaw_step(states)
        if step == "restore":
            perm = self._permutation(job)
            need: dict[int, int] = {}
            for gpu, nbytes in rec.bytes_by_gpu().items():
                need[perm.get(gpu, gpu)] = need.get(perm.get(gpu, gpu), 0) + nbytes
            short = room_for(self.gpus, need)
            if short:
                if not job.reason.startswith("waiting for room"):
                    return Transition(now, event=NewEvent(K.RESTORE_DEFERRED, f"waiting for room before restoring: {short}"))
                return None
            gpu_map = self._gpu_map(perm)
            self._run(job, "restore", [p for p, s in zip(pids, states) if s == CHECKPOINTED],
                      lambda p: self.driver.restore(p, gpu_map))
        elif step == "unlock":
            self._run(job, "unlock", [p for p, s in zip(pids, states) if s == LOCKED], self.driver.unlock)
        elif step == "done":
            t = self._timings.pop(job.id, {})
            sample = () if self.driver.capability.simulated else (
                Sample("ram_resume_bps", job.parked_bytes, t.get("restore")),)
            moved = f" onto GPU {','.join(map(str, job.assigned))}" if sorted(job.assigned) != sorted(job.home_gpus) else ""
            self._forget(job)
            return Transition(now, dict(state=JobState.RUNNING, parked=None, parked_bytes=0, home_gpus=[],
                                        last_start=now), effects=sample,
                              event=NewEvent(K.THAWED, f"thawed{_sim(self.gpus)}{moved}: restore "
                                                       f"{t.get('restore', 0):.2f} s, unlock {t.get('unlock', 0):.2f} s"))
        else:
            return self._abort(job, now, f"the driver reports the job's CUDA state as {', '.join(states)}")
        return None

    def _rediscover(self, job_pid: int, job: JobRecord) -> Optional[FreezeRecord]:
        """No record (frozen by an older version): the driver itself tells which processes of the
        tree are CUDA processes (it answers only for those); the footprint is the parked bytes."""
        try:
            tree = [job_pid] + [p.pid for p in psutil.Process(job_pid).children(recursive=True)]
        except psutil.Error:
            return None
        found = []
        for p in tree:
            try:
                self.queries.state(p)
                found.append(p)
            except Unanswered:
                raise                 # a stopped process of the tree may be the CUDA one: wait
            except CheckpointError:
                continue
        if not found:
            return None
        home = job.home_gpus or job.assigned or [0]
        share = job.parked_bytes // (len(found) * len(home))
        return FreezeRecord(tuple(CudaProcess(p, start_ticks(p) or 0, g, share) for p in found for g in home))

    def _abort(self, job: JobRecord, now: float, why: str) -> Transition:
        """Stop a job that cannot go on; it ends FAILED with `why` once its process is gone."""
        return Transition(now, dict(cancel_requested=True, abort_reason=why),
                          NewEvent(K.ABORTING, f"{why}; stopping the job"))

    def _permutation(self, job: JobRecord) -> dict[int, int]:
        if not job.home_gpus or sorted(job.home_gpus) == sorted(job.assigned):
            return {}
        return gpu_permutation([g.index for g in self.gpus.list()], job.home_gpus, job.assigned)

    def _gpu_map(self, perm: dict[int, int]) -> Optional[dict[str, str]]:
        """UUID pairs for a restore onto other GPUs (a permutation of every GPU, transparent.py)."""
        if not perm:
            return None
        uuids = {g.index: g.uuid for g in self.gpus.list()}
        return {uuids[a]: uuids[b] for a, b in perm.items()}


def _sim(gpus: GpuInventory) -> str:
    return " (SIMULATED driver)" if gpus.simulated else ""
