"""Transparent parking of unmodified jobs: freeze = lock -> checkpoint -> SIGSTOP; thaw = SIGCONT ->
restore -> unlock.

Level-triggered like the rest of the node: each tick reads the driver's state for the job's CUDA
process and takes the one step that is missing, so a daemon killed mid-freeze resumes where the
driver says the process is. Driver calls block (a checkpoint of 16 GiB takes seconds), so they
run on a small thread pool, at most one per job; the control loop only starts them and reads
their results.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import psutil

from gpuswap.node.cuda_ckpt import CHECKPOINTED, LOCKED, RUNNING, CheckpointDriver, CheckpointError
from gpuswap.node.gpus import GpuInventory

ROOM_MARGIN_BYTES = 256 * 2**20      # restore only with this much to spare (plus 5 %): an OOM restore
ROOM_MARGIN_FRACTION = 0.05          # leaves the process stuck for good (NVIDIA/cuda-checkpoint#44)


@dataclass(frozen=True)
class StepResult:
    step: str                 # lock | checkpoint | restore | unlock
    seconds: float
    error: Optional[CheckpointError]


def next_freeze_step(driver_state: str, stopped: bool) -> str:
    """The missing move towards 'frozen': lock, checkpoint, stop, done or failed."""
    if driver_state == RUNNING:
        return "lock"
    if driver_state == LOCKED:
        return "checkpoint"
    if driver_state == CHECKPOINTED:
        return "done" if stopped else "stop"
    return "failed"


def next_thaw_step(driver_state: str, stopped: bool) -> str:
    """The missing move towards 'running': cont, restore, unlock, done or failed."""
    if stopped:
        return "cont"
    if driver_state == CHECKPOINTED:
        return "restore"
    if driver_state == LOCKED:
        return "unlock"
    if driver_state == RUNNING:
        return "done"
    return "failed"


class StepRunner:
    """Runs blocking driver calls off the control loop, one in flight per job."""

    def __init__(self, driver: CheckpointDriver, workers: int = 4):
        self.driver = driver
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt")
        self._ops: dict[int, Future] = {}

    def busy(self, job_id: int) -> bool:
        f = self._ops.get(job_id)
        return f is not None and not f.done()

    def result(self, job_id: int) -> Optional[StepResult]:
        """The finished step's result, once; None while running or when nothing ran."""
        f = self._ops.get(job_id)
        if f is None or not f.done():
            return None
        del self._ops[job_id]
        return f.result()

    def start(self, job_id: int, step: str, call: Callable[[], None]) -> None:
        if self.busy(job_id):
            return

        def run() -> StepResult:
            t0 = time.monotonic()
            try:
                call()
                return StepResult(step, time.monotonic() - t0, None)
            except CheckpointError as e:
                return StepResult(step, time.monotonic() - t0, e)
            except Exception as e:   # a binding raising instead of returning a CUresult
                return StepResult(step, time.monotonic() - t0, CheckpointError(step, repr(e)))

        self._ops[job_id] = self._pool.submit(run)


def job_cuda_pids(job_pid: int, gpus: GpuInventory, assigned: list[int], simulated: bool) -> list[int]:
    """The job's processes that hold CUDA state: NVML's compute processes within its process tree."""
    if simulated:
        return [job_pid]
    try:
        tree = {job_pid} | {p.pid for p in psutil.Process(job_pid).children(recursive=True)}
    except psutil.Error:
        return []
    on_gpus = {p.pid for g in gpus.list() if g.index in assigned for p in g.processes}
    return sorted(tree & on_gpus)


def footprint(job_pid: int, gpus: GpuInventory, assigned: list[int], per_gpu: int) -> int:
    """Device bytes the job's CUDA processes hold on all its GPUs, per NVML (what a freeze will
    move); unknown (simulated GPUs, or NVML sees none): `per_gpu` (reported or declared) on each."""
    fallback = per_gpu * max(len(assigned), 1)
    if gpus.simulated:
        return fallback
    try:
        tree = {job_pid} | {p.pid for p in psutil.Process(job_pid).children(recursive=True)}
    except psutil.Error:
        return fallback
    used = sum(p.used_bytes or 0 for g in gpus.list() if g.index in assigned for p in g.processes if p.pid in tree)
    return used or fallback


def room_for(gpus: GpuInventory, targets: list[int], nbytes_per_gpu: int) -> Optional[str]:
    """None if every target GPU can take the job back with margin; else why not."""
    if gpus.simulated:
        return None     # simulated GPUs are allocated whole, so an assigned GPU is empty
    need = int(nbytes_per_gpu * (1 + ROOM_MARGIN_FRACTION)) + ROOM_MARGIN_BYTES
    for g in gpus.list():
        if g.index in targets and g.mem_used is not None and g.mem_total - g.mem_used < need:
            return f"GPU {g.index} has {(g.mem_total - g.mem_used) / 2**30:.1f} GiB free, needs {need / 2**30:.1f} GiB"
    return None

