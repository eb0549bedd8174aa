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
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as NoAnswerYet
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil

from gpuswap.node.cuda_ckpt import CHECKPOINTED, LOCKED, RUNNING, CheckpointDriver, CheckpointError
from gpuswap.fsutil import atomic_write_json, read_json
from gpuswap.node.gpus import GpuInventory
from gpuswap.simcuda import start_ticks, stopped

ROOM_MARGIN_BYTES = 256 * 2**20      # restore only with this much to spare (plus 5 %): an OOM restore
ROOM_MARGIN_FRACTION = 0.05          # leaves the process stuck for good (NVIDIA/cuda-checkpoint#44)


@dataclass(frozen=True)
class StepResult:
    step: str                 # lock | checkpoint | restore | unlock
    seconds: float
    error: Optional[CheckpointError]


@dataclass(frozen=True)
class CudaProcess:
    pid: int
    start: int          # start time in clock ticks: a reused pid is not this process
    gpu: int
    nbytes: int         # device memory it held when measured (NVML's usedGpuMemory)


@dataclass(frozen=True)
class FreezeRecord:
    """What the daemon learnt when it locked a job: its CUDA processes and their footprint, taken
    before the checkpoint (afterwards NVML lists neither) and kept in the run directory, so that
    every later tick, thaw and daemon restart uses them rather than a fresh NVML look-up.
    `checkpointed`: every process was checkpointed before the process tree was stopped (once it
    is stopped the driver is not asked: its calls need the process's own threads to run).

    Written before the first lock, it is also the durable fact that the driver may hold the job:
    a freeze given up on keeps it, marked `refused` (why), until what the driver holds is put back
    (Freezer.undoing). A process its user stopped is answered for only once continued, so that
    can take any time, across daemon restarts; without the file a restarted daemon had no reason
    to ask the driver about a RUNNING job, and its locked process hung at its next CUDA call.
    `retry`: the refusal was only the stop, so the job may be frozen again once put back."""

    processes: tuple[CudaProcess, ...]
    checkpointed: bool = False
    refused: Optional[str] = None
    retry: bool = False

    @property
    def pids(self) -> list[int]:
        return sorted({c.pid for c in self.processes})

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.processes)

    def bytes_by_gpu(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for c in self.processes:
            out[c.gpu] = out.get(c.gpu, 0) + c.nbytes
        return out

    def alive(self) -> list[int]:
        """The recorded processes that still exist as themselves (not a reused pid)."""
        return sorted({c.pid for c in self.processes if start_ticks(c.pid) == c.start})

    def save(self, path: Path) -> None:
        atomic_write_json(path, {"processes": [asdict(c) for c in self.processes], "checkpointed": self.checkpointed,
                                 "refused": self.refused, "retry": self.retry})

    @classmethod
    def load(cls, path: Path) -> Optional["FreezeRecord"]:
        try:
            d = read_json(path)
            if d is None:
                return None
            procs = tuple(CudaProcess(int(c["pid"]), int(c["start"]), int(c["gpu"]), int(c["nbytes"]))
                          for c in d["processes"])
            refused = d.get("refused")
            return cls(procs, bool(d.get("checkpointed")), None if refused is None else str(refused),
                       bool(d.get("retry")))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def next_freeze_step(states: list[str]) -> str:
    """The missing move towards 'frozen' for a job's CUDA processes (their driver states, read
    while the tree runs): lock every one first, then checkpoint every one (as CRIU's cuda plugin
    does), then stop; or failed."""
    if not states or any(s not in (RUNNING, LOCKED, CHECKPOINTED) for s in states):
        return "failed"
    if RUNNING in states:
        return "lock"
    if LOCKED in states:
        return "checkpoint"
    return "stop"


def next_thaw_step(states: list[str]) -> str:
    """The missing move towards 'running' once the tree was continued (SIGCONT comes first: the
    driver is never asked about a stopped process): restore every one, unlock every one, done."""
    if not states or any(s not in (RUNNING, LOCKED, CHECKPOINTED) for s in states):
        return "failed"
    if CHECKPOINTED in states:
        return "restore"
    if LOCKED in states:
        return "unlock"
    return "done"


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


# How long the control loop waits for the driver's answer about one process.
ANSWER_S = 5.0


class Unanswered(CheckpointError):
    """The driver was not asked, or gave no answer in time: the process is stopped by a signal.
    `stopped`: it was seen stopped (/proc), not merely slow to answer."""

    def __init__(self, call: str, code: str, stopped: bool = False):
        super().__init__(call, code)
        self.stopped = stopped


class StateQueries:
    """`driver.state(pid)` for the control loop, never blocking it for long.

    The real driver does not answer about a SIGSTOPped process: on an H100 (driver 580.159.04,
    2026-11-26) cuCheckpointProcessGetState and cuCheckpointProcessLock on a stopped process gave
    no answer in 15 s, and answered at once after SIGCONT. A job's user may stop its process
    (`kill -STOP`, Ctrl-Z), so asking inline would stall every job's control loop. A stopped
    process (/proc) is not asked at all; a process stopped between that look and the call leaves
    one worker waiting (one per pid at most) and the loop goes on after ANSWER_S."""

    def __init__(self, driver: CheckpointDriver, workers: int = 4, answer_s: float = ANSWER_S):
        self.driver, self.answer_s, self.workers = driver, answer_s, workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-state")
        self._pending: dict[int, Future] = {}

    def state(self, pid: int) -> str:
        """running | locked | checkpointed | failed; CheckpointError from the driver, Unanswered
        for a process that is stopped or did not answer."""
        f = self._pending.get(pid)
        # A question in flight is waited for again only while its process runs: else each tick
        # of a thaw waited answer_s for a process still stopped.
        if (f is None or not f.done()) and stopped(pid):
            raise Unanswered("cuCheckpointProcessGetState", f"process {pid} is stopped by a signal "
                             f"(SIGSTOP): the driver answers nothing about a stopped process", stopped=True)
        if f is None:
            if len(self._pending) >= self.workers:
                self._reap()
            if len(self._pending) >= self.workers:
                raise Unanswered("cuCheckpointProcessGetState", "the driver has not answered about other stopped "
                                                                "processes yet")
            f = self._pending[pid] = self._pool.submit(self.driver.state, pid)
        try:
            answer = f.result(timeout=self.answer_s)
        except NoAnswerYet:
            raise Unanswered("cuCheckpointProcessGetState", f"no answer about process {pid} in "
                             f"{self.answer_s:g} s (stopped by a signal?)") from None
        except CheckpointError:
            del self._pending[pid]
            raise
        except Exception as e:       # a binding raising instead of returning a CUresult
            del self._pending[pid]
            raise CheckpointError("cuCheckpointProcessGetState", repr(e)) from None
        del self._pending[pid]
        return answer

    def _reap(self) -> None:
        for pid in [p for p, f in self._pending.items() if f.done()]:
            del self._pending[pid]


def job_cuda_processes(job_pid: int, gpus: GpuInventory) -> list[CudaProcess]:
    """The job's processes that hold device memory now, with what they hold on which GPU: NVML's
    compute processes within its process tree (the launched command and every descendant; the
    CUDA process is often a child: `bash run.sh`, `torchrun`, `uv run`). A process already
    checkpointed by the driver is not listed by NVML: ask this only before a freeze."""
    try:
        tree = {job_pid} | {p.pid for p in psutil.Process(job_pid).children(recursive=True)}
    except psutil.Error:
        return []
    out = [CudaProcess(p.pid, start_ticks(p.pid) or 0, g.index, p.used_bytes or 0)
           for g in gpus.list() for p in g.processes if p.pid in tree]
    return sorted(out, key=lambda c: (c.pid, c.gpu))


def room_for(gpus: GpuInventory, need_by_gpu: dict[int, int]) -> Optional[str]:
    """None if every target GPU can take back what will land on it, with margin; else why not.
    A GPU whose use is unknown (a simulated one no CUDA process touched) counts as empty."""
    for g in gpus.list():
        if g.index not in need_by_gpu:
            continue
        need = int(need_by_gpu[g.index] * (1 + ROOM_MARGIN_FRACTION)) + ROOM_MARGIN_BYTES
        free = g.mem_total - (g.mem_used or 0)
        if free < need:
            return f"GPU {g.index} has {free / 2**30:.1f} GiB free, needs {need / 2**30:.1f} GiB"
    return None


def gpu_permutation(all_gpus: list[int], home: list[int], assigned: list[int]) -> dict[int, int]:
    """Old GPU -> new GPU for a restore onto other GPUs: a permutation of every GPU of the node.
    The driver wants every GPU mapped (CUDA docs: "every checkpointed GPU"; NVIDIA's migration
    tests map every GPU the kernel driver sees; cuda-checkpoint#35: one pair alone is refused), so
    home[i] -> assigned[i], and the GPUs that are left pair up in order, each one exactly once."""
    perm = dict(zip(home, assigned))
    rest_old = [g for g in all_gpus if g not in perm]
    rest_new = [g for g in all_gpus if g not in perm.values()]
    perm.update(zip(rest_old, rest_new))
    return perm
