"""The CUDA driver's process-checkpoint API (driver >= 570, CUDA 12.8+), behind one small interface.

`cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState` copy a process's device memory into
host memory owned by that process, release the GPU completely (context included), and later put
it back at the same virtual addresses. The daemon calls them from its own long-lived process
through cuda-bindings (>= 13.0.3: 13.0.0-13.0.2 lack cuCheckpointProcessRestore and
CUcheckpointRestoreArgs) instead of spawning the `cuda-checkpoint` binary for each step.

`node/simdriver.py` stands in where there is no GPU, as strict as the real driver observably is
(docs/transparent.md); it is how the transparent path runs end to end on CI.
"""
from __future__ import annotations

import abc
import subprocess
from dataclasses import dataclass, field
from typing import Optional

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
MIN_BINDINGS = (13, 0, 3)
MIN_DRIVER_CHECKPOINT = 570

# Why no node offers restoring a frozen job onto another GPU, though drivers >= 580 take GPU pairs:
# the daemon starts every job with CUDA_VISIBLE_DEVICES naming its own GPUs only, and the driver
# refuses a GPU map for a process that does not see every GPU with CUDA_ERROR_INVALID_VALUE
# (NVIDIA/cuda-python#1983: even an identity map, 2 of 4 GPUs visible; its
# cuda_core/tests/test_checkpoint.py skips migration under CUDA_VISIBLE_DEVICES; NVBug 5437334).
# A failed restore cannot be retried (NVIDIA/cuda-checkpoint#44) and would end the job, so a
# frozen job waits for its own GPUs instead. The simulated driver refuses such a map too.
NO_MIGRATION = "restores stay on each job's own GPUs (no GPU map under CUDA_VISIBLE_DEVICES)"


# What the driver answers about a pid that holds no CUDA state: NOT_INITIALIZED for a live
# process (a launcher shell), OPERATING_SYSTEM for one that has exited. Measured on an H100
# (driver 580.159.04, 2026-11-26; docs/transparent.md); CUDA's documentation lists neither.
NO_CUDA_STATE = frozenset({"CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_OPERATING_SYSTEM"})


class CheckpointError(Exception):
    """A driver call failed. `code` is the CUresult name, e.g. CUDA_ERROR_TIMEOUT."""

    def __init__(self, call: str, code: str):
        super().__init__(f"{call} failed: {code}")
        self.call, self.code = call, code

    @property
    def no_cuda_state(self) -> bool:
        """The pid holds nothing the driver could hold (`NO_CUDA_STATE`); any other error says
        nothing of what the driver holds."""
        return self.code in NO_CUDA_STATE

    @property
    def timed_out(self) -> bool:
        """A lock that ran out of time. The CUDA docs list CUDA_ERROR_NOT_READY as the one return
        of cuCheckpointProcessLock beyond the common ones (it leaves the process RUNNING);
        CUDA_ERROR_TIMEOUT is kept in case a driver uses it."""
        return self.code in ("CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT")


@dataclass(frozen=True)
class Capability:
    """What this node can do transparently; shown by `gpuswap gpus`."""

    available: bool
    reason: str                       # why not, or a one-line description of what is there
    driver: Optional[str] = None
    bindings: Optional[str] = None
    migration: bool = False           # restore onto another GPU; never offered today: NO_MIGRATION
    persistence: dict[int, bool] = field(default_factory=dict)
    simulated: bool = False
    criu: str = "not checked"         # transparent disk tier: CRIU's own verdict


class CheckpointDriver(abc.ABC):
    capability: Capability

    @abc.abstractmethod
    def state(self, pid: int) -> str:
        """running | locked | checkpointed | failed (raises CheckpointError if pid has no CUDA state)."""

    @abc.abstractmethod
    def lock(self, pid: int, timeout_ms: int) -> None:
        """Wait for in-flight work, then block the process's further CUDA calls."""

    @abc.abstractmethod
    def checkpoint(self, pid: int) -> None:
        """Copy device memory into the process's host memory and release the GPU."""

    @abc.abstractmethod
    def restore(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        """Put device memory back; `gpu_map` (old UUID -> new UUID) migrates to other GPUs."""

    @abc.abstractmethod
    def unlock(self, pid: int) -> None:
        """Let the process make CUDA calls again."""


class CudaCheckpointDriver(CheckpointDriver):
    """The real driver API through cuda.bindings.driver."""

    def __init__(self, capability: Capability):
        from cuda.bindings import driver

        self.d = driver
        self.capability = capability
        self._call("cuInit", driver.cuInit, 0)   # restore needs an initialized driver or persistence mode
        self._states = {getattr(driver.CUprocessState, f"CU_PROCESS_STATE_{s.upper()}"): s
                        for s in (RUNNING, LOCKED, CHECKPOINTED, FAILED)}

    def _call(self, name: str, fn, *args):  # type: ignore[no-untyped-def]
        result = fn(*args)
        err = result[0] if isinstance(result, tuple) else result
        if err != self.d.CUresult.CUDA_SUCCESS:
            raise CheckpointError(name, getattr(err, "name", str(err)))
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def state(self, pid: int) -> str:
        return self._states.get(self._call("cuCheckpointProcessGetState", self.d.cuCheckpointProcessGetState, pid),
                                FAILED)

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.d.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        self._call("cuCheckpointProcessLock", self.d.cuCheckpointProcessLock, pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", self.d.cuCheckpointProcessCheckpoint, pid, None)

    def restore(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        args = None
        if gpu_map:
            import ctypes

            keep: list[object] = []

            def uuid(text: str):  # type: ignore[no-untyped-def]
                raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
                buf = ctypes.create_string_buffer(raw, 16)
                keep.append(buf)
                return self.d.CUuuid(ctypes.addressof(buf))

            pairs = []
            for old, new in gpu_map.items():
                pair = self.d.CUcheckpointGpuPair()
                pair.oldUuid, pair.newUuid = uuid(old), uuid(new)
                pairs.append(pair)
            args = self.d.CUcheckpointRestoreArgs()
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._call("cuCheckpointProcessRestore", self.d.cuCheckpointProcessRestore, pid, args)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", self.d.cuCheckpointProcessUnlock, pid, None)


class UnavailableDriver(CheckpointDriver):
    """This node cannot park transparently; every call says why (the policy never asks)."""

    def __init__(self, capability: Capability):
        self.capability = capability

    def _no(self, call: str) -> None:
        raise CheckpointError(call, f"unavailable: {self.capability.reason}")

    def state(self, pid: int) -> str:
        self._no("cuCheckpointProcessGetState")
        return FAILED

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._no("cuCheckpointProcessLock")

    def checkpoint(self, pid: int) -> None:
        self._no("cuCheckpointProcessCheckpoint")

    def restore(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        self._no("cuCheckpointProcessRestore")

    def unlock(self, pid: int) -> None:
        self._no("cuCheckpointProcessUnlock")


def criu_verdict() -> str:
    """'ok' if `criu check` passes here, else why not (CRIU dumps need kernel features many hosts lack)."""
    try:
        r = subprocess.run(["criu", "check"], capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        return "criu is not installed"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"criu check could not run: {e}"
    if r.returncode == 0:
        return "ok"
    last = (r.stderr or r.stdout).strip().splitlines()
    return f"criu check failed: {last[-1] if last else 'exit ' + str(r.returncode)}"


def detect(nvml_persistence: dict[int, bool], driver_version: Optional[str]) -> Capability:
    """Capability of the real driver API on this node, with the reason when it is absent."""
    major = int(driver_version.split(".")[0]) if driver_version else 0
    if major and major < MIN_DRIVER_CHECKPOINT:
        return Capability(False, f"driver {driver_version} predates the checkpoint API (needs >= 570)",
                          driver=driver_version, persistence=nvml_persistence)
    try:
        from importlib.metadata import version

        from cuda.bindings import driver
        bindings = version("cuda-bindings")
    except Exception as e:   # not installed, or its native part fails to load
        return Capability(False, f"cuda-bindings is not usable ({e}); pip install 'gpuswap[cuda]'",
                          driver=driver_version, persistence=nvml_persistence)
    parts = tuple(int(p) for p in bindings.split(".")[:3] if p.isdigit())
    missing = [n for n in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                           "cuCheckpointProcessUnlock", "cuCheckpointProcessGetState", "CUcheckpointLockArgs",
                           "CUcheckpointRestoreArgs") if not hasattr(driver, n)]
    if missing or parts < MIN_BINDINGS:
        return Capability(False, f"cuda-bindings {bindings} lacks {', '.join(missing) or 'a fixed restore'}; "
                                 "needs >= 13.0.3", driver=driver_version, bindings=bindings,
                          persistence=nvml_persistence)
    note = "" if all(nvml_persistence.values()) else "; persistence mode is off on some GPUs (restore calls cuInit)"
    return Capability(True, f"CUDA checkpoint API, driver {driver_version}, cuda-bindings {bindings}; "
                            f"{NO_MIGRATION}{note}", driver=driver_version,
                      bindings=bindings, migration=False, persistence=nvml_persistence, criu=criu_verdict())
