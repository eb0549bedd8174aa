"""Job-level flow of transparent parking: which mechanism parks a job, and the freeze/thaw moves
that turn the driver's state into job states and events.

Every failure ends in a defined state with its reason: a lock that times out or a driver that
refuses leaves the job RUNNING (unlocked) and not preempted transparently again; a process that
exits while frozen ends by its exit code; a failed restore, which the driver cannot retry
(NVIDIA/cuda-checkpoint#44), ends the job FAILED rather than leaving it stuck.
"""
from __future__ import annotations

from typing import Any, Optional

from gpuswap.jobs import JobState, format_size
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.cuda_ckpt import CheckpointDriver, CheckpointError
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.launcher import Observation
from gpuswap.node.store import JobRecord, Store
from gpuswap.node.transparent import (StepRunner, footprint, job_cuda_pids, next_freeze_step, next_thaw_step,
                                      room_for)

LOCK_TIMEOUT_MS = 10_000


def mechanism_for(job: JobRecord, transparent_ok: bool) -> Optional[str]:
    """How a pause of this job would be carried out, or None if it cannot be parked at all."""
    if job.pause_mode == "cooperative":
        return "cooperative"
    driver_ok = transparent_ok and not job.transparent_refused
    if job.pause_mode == "transparent":
        return "transparent" if driver_ok else None
    if job.attached:
        return "cooperative"
    return "transparent" if driver_ok else "cooperative"   # cooperative: falls back if it never attaches


def tiers_for(job: JobRecord, transparent_ok: bool) -> frozenset[str]:
    """The tiers the policy may choose for this job now. The transparent disk tier would need CRIU,
    which gpuswap does not drive (see docs/transparent.md), so transparent jobs park in RAM only."""
    mech = mechanism_for(job, transparent_ok)
    if mech == "cooperative" and not job.no_runtime:
        return frozenset({"ram", "disk"})
    if mech == "transparent":
        return frozenset({"ram"})
    return frozenset()


class Freezer:
    def __init__(self, store: Store, driver: CheckpointDriver, gpus: GpuInventory, bandwidths: Bandwidths):
        self.store, self.driver, self.gpus, self.bandwidths = store, driver, gpus, bandwidths
        self.runner = StepRunner(driver)
        self._timings: dict[int, dict[str, float]] = {}

    @property
    def migration(self) -> bool:
        return self.driver.capability.migration

    # -- freeze -----------------------------------------------------------------------------
    def _ready(self, job: JobRecord, obs: Observation) -> tuple[Optional[int], Optional[CheckpointError]]:
        """(job pid, error of the step that just finished); pid None while there is nothing to do
        (no process yet, or a driver call still in flight)."""
        pid = obs.job_pid
        done = self.runner.result(job.id)
        if done is not None:
            self._timings.setdefault(job.id, {})[done.step] = done.seconds
        if not pid or self.runner.busy(job.id):
            return None, None
        return pid, done.error if done is not None else None

    def freezing(self, job: JobRecord, obs: Observation, now: float) -> None:
        pid, error = self._ready(job, obs)
        if error is not None and pid:
            self._refuse(job, now, error, pid)
            return
        if not pid:
            return
        pids = job_cuda_pids(pid, self.gpus, job.assigned, self.gpus.simulated)
        if len(pids) != 1:
            why = ("no CUDA process found in the job" if not pids else
                   f"{len(pids)} CUDA processes ({', '.join(map(str, pids))}) share the job; transparent "
                   "parking supports one CUDA process per job")
            self._refuse(job, now, why, pid)
            return
        cuda_pid = pids[0]
        try:
            state = self.driver.state(cuda_pid)
        except CheckpointError as e:
            self._refuse(job, now, e, pid)
            return
        step = next_freeze_step(state, obs.stopped)
        if step == "lock" and job.ram_allowance is not None:
            need = footprint(pid, self.gpus, job.assigned, job.device_bytes or job.mem_bytes)
            if need > job.ram_allowance:
                self.store.update(job.id, now, state=JobState.RUNNING, hold=False,
                                  device_bytes=need // max(len(job.assigned), 1),
                                  desired_tier=None,
                                  event=f"not frozen: its {format_size(need)} would exceed the host-RAM budget "
                                        f"({format_size(job.ram_allowance)} left)")
                return
        if step == "lock":
            self.runner.start(job.id, "lock", lambda: self.driver.lock(cuda_pid, LOCK_TIMEOUT_MS))
        elif step == "checkpoint":
            self.runner.start(job.id, "checkpoint", lambda: self.driver.checkpoint(cuda_pid))
        elif step == "stop":
            if not job.stopped:
                self.store.update(job.id, now, stopped=True)
        elif step == "done":
            nbytes = footprint(pid, self.gpus, job.assigned, job.device_bytes or job.mem_bytes) if not job.parked_bytes \
                else job.parked_bytes
            t = self._timings.pop(job.id, {})
            if not self.driver.capability.simulated:   # it moved nothing: its timing is no bandwidth
                self.bandwidths.observe("ram_park_bps", nbytes, t.get("checkpoint"))
            self.store.update(
                job.id, now, state=JobState.PAUSED, parked="ram", parked_bytes=nbytes,
                home_gpus=job.assigned if not self.migration else job.assigned, assigned=[],
                event=f"frozen transparently{_sim(self.gpus)}: {format_size(nbytes)} moved to host RAM by the "
                      f"driver (lock {t.get('lock', 0):.2f} s, checkpoint {t.get('checkpoint', 0):.2f} s), "
                      "process tree stopped")
        else:
            self._abort(job, now, f"the driver reports the job's CUDA state as {state}")

    def _refuse(self, job: JobRecord, now: float, error: Any, pid: int) -> None:
        """Give up on freezing this job: undo a lock if one was taken, keep it running, say why."""
        why = f"lock timed out after {LOCK_TIMEOUT_MS / 1000:.0f} s" if getattr(error, "timed_out", False) else str(error)
        try:
            for cuda_pid in job_cuda_pids(pid, self.gpus, job.assigned, self.gpus.simulated):
                if self.driver.state(cuda_pid) == "locked":
                    self.driver.unlock(cuda_pid)
        except CheckpointError:
            pass
        self._timings.pop(job.id, None)
        self.store.update(job.id, now, state=JobState.RUNNING, stopped=False, hold=False, transparent_refused=why,
                          desired="running", desired_tier=None,
                          event=f"cannot freeze transparently ({why}): left running; not parked transparently again")

    # -- thaw -------------------------------------------------------------------------------
    def thawing(self, job: JobRecord, obs: Observation, now: float) -> None:
        pid, error = self._ready(job, obs)
        if error is not None:
            self._abort(job, now, f"thaw failed ({error}); the driver cannot retry a failed restore")
            return
        if not pid:
            return
        [cuda_pid] = job_cuda_pids(pid, self.gpus, job.home_gpus or job.assigned, self.gpus.simulated) or [pid]
        try:
            state = self.driver.state(cuda_pid)
        except CheckpointError as e:
            self._abort(job, now, f"thaw failed ({e})")
            return
        step = next_thaw_step(state, obs.stopped)
        if step == "cont":
            if job.stopped:
                self.store.update(job.id, now, stopped=False)
        elif step == "restore":
            short = room_for(self.gpus, job.assigned, job.parked_bytes // max(1, job.gpus))
            if short:
                if not job.reason.startswith("waiting for room"):
                    self.store.update(job.id, now, event=f"waiting for room before restoring: {short}")
                return
            gpu_map = self._gpu_map(job)
            self.runner.start(job.id, "restore", lambda: self.driver.restore(cuda_pid, gpu_map))
        elif step == "unlock":
            self.runner.start(job.id, "unlock", lambda: self.driver.unlock(cuda_pid))
        elif step == "done":
            t = self._timings.pop(job.id, {})
            if not self.driver.capability.simulated:
                self.bandwidths.observe("ram_resume_bps", job.parked_bytes, t.get("restore"))
            moved = f" onto GPU {','.join(map(str, job.assigned))}" if sorted(job.assigned) != sorted(job.home_gpus) else ""
            self.store.update(job.id, now, state=JobState.RUNNING, parked=None, parked_bytes=0, home_gpus=[],
                              last_start=now,
                              event=f"thawed{_sim(self.gpus)}{moved}: restore {t.get('restore', 0):.2f} s, "
                                    f"unlock {t.get('unlock', 0):.2f} s")
        else:
            self._abort(job, now, f"the driver reports the job's CUDA state as {state}")

    def _abort(self, job: JobRecord, now: float, why: str) -> None:
        """Stop a job that cannot go on; it ends FAILED with `why` once its process is gone."""
        self.store.update(job.id, now, cancel_requested=True, abort_reason=why, event=f"{why}; stopping the job")

    def _gpu_map(self, job: JobRecord) -> Optional[dict[str, str]]:
        """UUID pairs for a restore onto other GPUs. The driver wants every GPU it knows mapped,
        so the moved GPUs swap places and all others map to themselves."""
        if not job.home_gpus or sorted(job.home_gpus) == sorted(job.assigned):
            return None
        uuids = {g.index: g.uuid for g in self.gpus.list()}
        perm = {i: i for i in uuids}
        for old, new in zip(job.home_gpus, job.assigned):
            perm[old], perm[new] = new, old
        return {uuids[a]: uuids[b] for a, b in perm.items()}


def _sim(gpus: GpuInventory) -> str:
    return " (SIMULATED driver)" if gpus.simulated else ""
