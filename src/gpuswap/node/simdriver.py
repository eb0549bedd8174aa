"""The simulated CUDA checkpoint driver: the real API's observable behaviour, without a GPU.

It acts on the simulated CUDA processes of gpuswap.simcuda and keeps its record of each in that
registry (so a daemon restart finds the process where the driver left it, as with the real
driver, whose state lives in the process). Every rule below is what the real driver does as far
as its documentation and issue tracker show; docs/transparent.md gives each one's source.

- Only a CUDA process has checkpoint state: every call on another pid fails, with
  CUDA_ERROR_NOT_INITIALIZED for a live process (the launcher's shell) and
  CUDA_ERROR_OPERATING_SYSTEM for one that has exited (measured on an H100, below).
- lock: RUNNING -> LOCKED, after in-flight work finishes; a process with a kernel that does not
  finish (`busy`, until it registers again without it) makes it wait up to `timeout_ms` and
  return CUDA_ERROR_NOT_READY, leaving it RUNNING (NOT_READY is lock's only extra documented
  return; "left in the RUNNING state"). `timeout_ms` 0 waits as long as the work runs
  (CUcheckpointLockArgs: "0 indicates no timeout"). Stricter than seen on an H100: a lock with
  a 300 ms timeout, asked while a ~2 s kernel ran, locked in 0.11 s; when the real driver
  answers NOT_READY is not established, so the daemon's handling of it stays tested here.
- lock keeps every byte on the device, its context included: a locked process is still listed.
- checkpoint and restore take the time an H100 took for as many bytes (CHECKPOINT_BYTES_PER_S,
  RESTORE_BYTES_PER_S below; measured, docs/selftest.md).
- checkpoint: LOCKED -> CHECKPOINTED; the process's memory leaves the device, its CUDA context's
  included ("all underlying references will be released", cuCheckpointProcessCheckpoint;
  nvidia-smi shows 1 MiB used and no process: NVIDIA/cuda-checkpoint#31), and it vanishes from
  the NVML process list (cuda-checkpoint README). A restore needs room for all of it again.
- restore: CHECKPOINTED -> LOCKED, back on every GPU it held or, with GPU pairs, on the mapped
  ones (each GPU of the process moved as the map says; simcuda.DriverRecord keeps where). A map
  is refused with CUDA_ERROR_INVALID_VALUE, the process left CHECKPOINTED (NVIDIA's own tests
  restore it without a map after that error), when:
  * it does not cover every GPU (CUDA docs: "must contain every checkpointed GPU"; NVIDIA's
    migration tests and cuda-checkpoint#35: a map of one pair on a 4-GPU node fails with
    invalid argument);
  * it is not one-to-one (two GPUs sent to one). Our reading: the docs only say each pair maps
    "the GPU that was checkpointed" to "the GPU to restore onto", and every map NVIDIA's tests
    use is a permutation (a rotation, a swap);
  * the process does not see every GPU: its CUDA_VISIBLE_DEVICES (read from /proc/PID/environ,
    the environment it started with; unreadable counts as hiding) leaves some out. NVIDIA's
    cuda-core tests (cuda_core/tests/test_checkpoint.py) skip migration under
    CUDA_VISIBLE_DEVICES, "the checkpoint mapping must cover every GPU visible to the
    kernel-mode driver", and their author found even an identity map refused with
    CUDA_ERROR_INVALID_VALUE when 2 of 4 GPUs were visible (NVIDIA/cuda-python#1983, NVBug
    5437334). The daemon starts every job so, and therefore never asks for a map (the
    capability below says no migration; docs/transparent.md).
  Too little free memory on the target: CUDA_ERROR_OUT_OF_MEMORY, the process stays
  CHECKPOINTED and is stuck for good: every later restore fails with CUDA_ERROR_OPERATING_SYSTEM
  and unlock with CUDA_ERROR_ILLEGAL_STATE (cuda-checkpoint#44). "Room" is counted as simcuda
  counts it for an allocation, on each GPU the process comes back to: every other resident
  process's contexts and allocations there (a checkpointed one holds nothing) plus all this process
  brings back there, its context included, against the GPU's total; too little on any one fails
  the whole restore (one call restores the whole process, and a failed one leaves it
  CHECKPOINTED, cuda-checkpoint#44); the check and the new state are one step under the device's lock
  (SimDevice.exclusive), so a process allocating meanwhile cannot take the same bytes.
- The simulated GPUs' sizes are written for the jobs (simcuda's gpus.json) when the driver starts:
  a simulated CUDA process's allocation is refused past its GPU's total, as a real one is.
- The device's lock is the only thing here a job's process can hold up; the driver waits for it at
  most LOCK_WAIT_S and then fails the call with SIMULATED_DEVICE_BUSY (the daemon never hangs on
  a job that stops while holding it; a well-behaved process holds it for one file write).
- unlock: LOCKED -> RUNNING. A call in the wrong state: CUDA_ERROR_ILLEGAL_STATE (documented).
- A call on a SIGSTOPped process blocks until the process is continued (or gone), as the real
  calls do: measured on an H100 (driver 580.159.04, 2026-11-26), cuCheckpointProcessGetState and
  cuCheckpointProcessLock on a stopped process gave no answer in 15 s and answered at once after
  SIGCONT. The daemon asks about no stopped process and waits for no answer for long
  (node/transparent.py's StateQueries).
- A call on a pid with no CUDA state: CUDA_ERROR_NOT_INITIALIZED for a live process,
  CUDA_ERROR_OPERATING_SYSTEM for one that has exited (both measured there).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Iterator, Optional

import psutil

from gpuswap.node.cuda_ckpt import CHECKPOINTED, LOCKED, NO_MIGRATION, RUNNING, Capability, CheckpointDriver, \
    CheckpointError, criu_verdict
from gpuswap.node.gpus import SimulatedGpus
from gpuswap.simcuda import DriverRecord, Registration, SimDevice, stopped

POLL_S = 0.02      # how often a waiting lock looks again at the process's work
LOCK_WAIT_S = 30.0  # the longest the driver waits for the simulated device's lock
# How fast the driver moves a process's device memory, as measured on an H100 (driver 580.159.04,
# 2026-11-26; docs/selftest.md, "On a real GPU"): a freeze (lock + checkpoint) of 4.6 GiB took
# 1.98 s, a thaw (restore + unlock) 0.82 s. A checkpoint or restore here takes as long for the bytes
# the process holds, so the daemon meets calls in flight as on a GPU node (its ticks, a cancel or
# a restart while one runs); they took no time before, which no real driver does.
CHECKPOINT_BYTES_PER_S = 4.6 * 2**30 / 1.98
RESTORE_BYTES_PER_S = 4.6 * 2**30 / 0.82


def _copy(seconds: float) -> None:
    """The time a checkpoint or restore spends copying (no bytes are moved here)."""
    time.sleep(seconds)


def visible_gpus(pid: int, gpus: SimulatedGpus) -> Optional[set[int]]:
    """The node's GPUs that process `pid` sees, by the CUDA_VISIBLE_DEVICES it started with (read
    from /proc/PID/environ: what CUDA reads when the process initializes it, unless the program
    changed its environment first); None if that cannot be read. As CUDA reads the variable: unset, every GPU; entries are
    indices or UUIDs, and the first that names no GPU ends the list (CUDA Programming Guide,
    "CUDA Environment Variables")."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    value = next((e[len(b"CUDA_VISIBLE_DEVICES="):] for e in env if e.startswith(b"CUDA_VISIBLE_DEVICES=")), None)
    if value is None:
        return set(range(gpus.count))
    by_uuid = {gpus.uuid(i): i for i in range(gpus.count)}
    seen: set[int] = set()
    for entry in value.decode(errors="replace").split(","):
        entry = entry.strip()
        index = int(entry) if entry.isdigit() else by_uuid.get(entry)
        if index is None or not 0 <= index < gpus.count:
            break
        seen.add(index)
    return seen


class SimulatedCheckpointDriver(CheckpointDriver):
    def __init__(self, gpus: SimulatedGpus, device: SimDevice):
        self.gpus, self.device = gpus, device
        device.prepare()
        device.describe([gpus.mem_total] * gpus.count)     # how big each GPU is, for the jobs' allocations
        # No migration, as a real node's capability says (cuda_ckpt.NO_MIGRATION): restore below
        # refuses a GPU map for a job that sees only its own GPUs, which is every job.
        self.capability = Capability(True, f"SIMULATED checkpoint driver (no GPU; no memory is moved); {NO_MIGRATION}",
                                     migration=False, simulated=True, criu=criu_verdict())

    def _proc(self, call: str, pid: int) -> tuple[Registration, DriverRecord]:
        reg = self.device.registration(pid)
        if reg is None:
            raise CheckpointError(call, "CUDA_ERROR_NOT_INITIALIZED" if psutil.pid_exists(pid)
                                  else "CUDA_ERROR_OPERATING_SYSTEM")
        return reg, self.device.driver_record(reg)

    @staticmethod
    def _answer_when_continued(pid: int) -> None:
        """The real driver answers nothing about a stopped process until it is continued."""
        while stopped(pid):
            time.sleep(POLL_S)

    @contextlib.contextmanager
    def _exclusive(self, call: str) -> Iterator[None]:
        """The simulated device's lock (simcuda.SimDevice.exclusive), bounded by LOCK_WAIT_S."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.device.exclusive(LOCK_WAIT_S))
            except (TimeoutError, OSError) as e:      # not what the block itself raises
                raise CheckpointError(call, f"SIMULATED_DEVICE_BUSY ({e})") from None
            yield

    def _expect(self, call: str, pid: int, state: str) -> tuple[Registration, DriverRecord]:
        reg, rec = self._proc(call, pid)
        if rec.state != state:
            raise CheckpointError(call, "CUDA_ERROR_ILLEGAL_STATE")
        return reg, rec

    def state(self, pid: int) -> str:
        self._answer_when_continued(pid)
        return self._proc("cuCheckpointProcessGetState", pid)[1].state

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Waits while the process's work runs (`busy` in its registration, read again each time):
        up to `timeout_ms`, or as long as it takes with 0 ("0 indicates no timeout"). The state
        changes under the device's lock, so no allocation of the process is half-way through."""
        call = "cuCheckpointProcessLock"
        self._answer_when_continued(pid)
        reg, rec = self._expect(call, pid, RUNNING)
        deadline = None if timeout_ms == 0 else time.monotonic() + timeout_ms / 1000
        while True:
            if not reg.busy:
                with self._exclusive(call):
                    reg, rec = self._expect(call, pid, RUNNING)
                    if not reg.busy:
                        self.device.set_driver_record(reg, replace(rec, state=LOCKED))
                        return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise CheckpointError(call, "CUDA_ERROR_NOT_READY")
            time.sleep(POLL_S if left is None else min(POLL_S, left))
            reg, rec = self._expect(call, pid, RUNNING)

    def checkpoint(self, pid: int) -> None:
        """The process's memory is copied out (CHECKPOINT_BYTES_PER_S), then leaves the device: it
        stays listed, LOCKED, while the copy runs; a process gone meanwhile fails the call."""
        call = "cuCheckpointProcessCheckpoint"
        self._answer_when_continued(pid)
        reg, rec = self._expect(call, pid, LOCKED)
        _copy(sum(n for _, n in self.device.placed(reg, rec)) / CHECKPOINT_BYTES_PER_S)
        reg, rec = self._expect(call, pid, LOCKED)
        self.device.set_driver_record(reg, replace(rec, state=CHECKPOINTED))

    def restore(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        """Room for all of it is taken first (or the restore fails, below), then the memory is
        copied back (RESTORE_BYTES_PER_S) before the call returns."""
        self._answer_when_continued(pid)
        call = "cuCheckpointProcessRestore"
        reg, rec = self._expect(call, pid, CHECKPOINTED)
        if rec.poisoned:
            raise CheckpointError(call, "CUDA_ERROR_OPERATING_SYSTEM")
        back = replace(rec, state=LOCKED)
        if gpu_map:
            back = replace(back, moved=self._mapped(call, pid, rec, gpu_map))
        with self._exclusive(call):          # the room it finds is the room it takes
            need: dict[int, int] = {}        # all it held on each GPU comes back, contexts too
            for gpu, used in self.device.placed(reg, back):
                need[gpu] = need.get(gpu, 0) + used
            if any(n > self.gpus.mem_total - self.device.used_on(g, but=pid) for g, n in need.items()):
                self.device.set_driver_record(reg, replace(rec, poisoned=True))
                raise CheckpointError(call, "CUDA_ERROR_OUT_OF_MEMORY")
            self.device.set_driver_record(reg, back)
        _copy(sum(need.values()) / RESTORE_BYTES_PER_S)

    def _mapped(self, call: str, pid: int, rec: DriverRecord, gpu_map: dict[str, str]) -> tuple[tuple[int, int], ...]:
        """Where each GPU is after a restore with `gpu_map` (the record's earlier moves, then the
        map: the pairs that are not the identity), or CUDA_ERROR_INVALID_VALUE (the process stays
        CHECKPOINTED) for a map that misses a GPU, sends two GPUs to one or names one not here, or
        for a process that does not see every GPU (the module docstring gives the sources)."""
        by_uuid = {self.gpus.uuid(i): i for i in range(self.gpus.count)}
        one_to_one = len(set(gpu_map.values())) == len(gpu_map)
        if set(gpu_map) != set(by_uuid) or not set(gpu_map.values()) <= set(by_uuid) or not one_to_one:
            raise CheckpointError(call, "CUDA_ERROR_INVALID_VALUE")
        if visible_gpus(pid, self.gpus) != set(by_uuid.values()):
            raise CheckpointError(call, "CUDA_ERROR_INVALID_VALUE")
        now = {g: by_uuid[gpu_map[self.gpus.uuid(rec.where(g))]] for g in range(self.gpus.count)}
        return tuple((a, b) for a, b in sorted(now.items()) if a != b)

    def unlock(self, pid: int) -> None:
        self._answer_when_continued(pid)
        reg, rec = self._proc("cuCheckpointProcessUnlock", pid)
        if rec.state != LOCKED or rec.poisoned:
            raise CheckpointError("cuCheckpointProcessUnlock", "CUDA_ERROR_ILLEGAL_STATE")
        self.device.set_driver_record(reg, replace(rec, state=RUNNING))
