"""What GPUs this node has: real ones through NVML, or simulated ones that say so.

Simulated devices exist so that the whole product runs on a laptop or CI; every record they
produce carries `simulated: True`. With a `SimDevice` (gpuswap.simcuda) attached, as the daemon
does, they list the simulated CUDA processes like `nvmlDeviceGetComputeRunningProcesses` and their
memory in use, each process's CUDA context included, on every GPU it holds memory on (a process
that touched two GPUs is listed on both): a process checkpointed by the driver is not listed and
holds nothing. A simulated
GPU no such process has touched reports `mem_used` None: its callers fill it in from job reports.
"""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import Optional

from gpuswap.jobs import parse_size
from gpuswap.simcuda import SimDevice


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: Optional[int]


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    mem_total: int
    mem_used: Optional[int]           # None: simulated, filled in from job reports by the caller
    simulated: bool
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)
    node: Optional[str] = None        # the pool node it is on (docs/ray.md); None on a single daemon


class GpuInventory(abc.ABC):
    simulated = False

    @abc.abstractmethod
    def list(self) -> list[GpuInfo]:
        """The node's GPUs now."""

    def visible_devices(self, indices: list[int]) -> str:
        """CUDA_VISIBLE_DEVICES value for these GPUs."""
        return ",".join(str(i) for i in indices)

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for people: what kind of GPUs, how many."""


MAX_SIMULATED = 1024


class SimulatedGpus(GpuInventory):
    simulated = True

    def __init__(self, count: int, mem_total: int, device: Optional[SimDevice] = None):
        self.count, self.mem_total, self.device = count, mem_total, device

    @classmethod
    def parse(cls, spec: str, name: str = "--simulate-gpus") -> "SimulatedGpus":
        """'2x80GiB' -> two simulated 80 GiB GPUs; '4' -> four of 80 GiB. A GPU without memory
        could hold no job, and thousands of them would only slow every tick: both are refused.
        `name` is how errors name the setting (the flag, or the config file's key)."""
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX*]\s*(.+))?", spec or "")
        if not m or not 1 <= int(m.group(1)) <= MAX_SIMULATED:
            raise ValueError(f"cannot read {name} {spec!r}; write COUNTxSIZE with a count from 1 "
                             f"to {MAX_SIMULATED}, e.g. 2x80GiB")
        try:
            mem = parse_size(m.group(2) or "80GiB")
        except ValueError as e:
            raise ValueError(f"cannot read {name} {spec!r}: {e}") from None
        if mem < 1:
            raise ValueError(f"{name} {spec!r} gives its GPUs no memory; write e.g. 2x80GiB")
        return cls(int(m.group(1)), mem)

    def list(self) -> list[GpuInfo]:
        procs: dict[int, list[GpuProcess]] = {}
        used: dict[int, int] = {}
        touched: set[int] = set()
        if self.device is not None:
            touched = self.device.gpus_in_use()
            for pid, gpu, nbytes, reported in self.device.listed():
                # a process whose usage NVML does not report still holds its memory (simcuda.allocate)
                procs.setdefault(gpu, []).append(GpuProcess(pid, nbytes if reported else None))
                used[gpu] = used.get(gpu, 0) + nbytes
        return [GpuInfo(i, "simulated GPU", self.uuid(i), self.mem_total,
                        used.get(i, 0) if i in touched else None, True, tuple(procs.get(i, ())))
                for i in range(self.count)]

    @staticmethod
    def uuid(index: int) -> str:
        """UUID-shaped, as the driver's GPU pairs need (hex, 16 bytes)."""
        return f"GPU-51300000-0000-0000-0000-{index:012x}"

    def describe(self) -> str:
        return f"{self.count} simulated GPU(s), no real GPU is used"


class NvmlGpus(GpuInventory):
    """Real GPUs. NVML indices follow PCI bus order, hence CUDA_DEVICE_ORDER=PCI_BUS_ID for jobs."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.count = pynvml.nvmlDeviceGetCount()
        self.driver = _text(pynvml.nvmlSystemGetDriverVersion())

    def list(self) -> list[GpuInfo]:
        nv = self._nvml
        out = []
        for i in range(self.count):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                procs = tuple(GpuProcess(p.pid, p.usedGpuMemory)
                              for p in nv.nvmlDeviceGetComputeRunningProcesses(h))
            except nv.NVMLError:
                procs = ()
            out.append(GpuInfo(i, _text(nv.nvmlDeviceGetName(h)), _text(nv.nvmlDeviceGetUUID(h)),
                               int(mem.total), int(mem.used), False, procs))
        return out

    def persistence(self) -> dict[int, bool]:
        """Persistence mode per GPU: restore without it needs cuInit in the restoring process."""
        nv, out = self._nvml, {}
        for i in range(self.count):
            try:
                out[i] = bool(nv.nvmlDeviceGetPersistenceMode(nv.nvmlDeviceGetHandleByIndex(i)))
            except nv.NVMLError:
                out[i] = False
        return out

    def visible_devices(self, indices: list[int]) -> str:
        # UUIDs: immune to index renumbering by CUDA_VISIBLE_DEVICES in the job's own environment.
        by_index = {g.index: g.uuid for g in self.list()}
        return ",".join(by_index[i] for i in indices)

    def describe(self) -> str:
        return f"{self.count} NVIDIA GPU(s) via NVML, driver {self.driver}"


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def detect(simulate: Optional[str]) -> GpuInventory:
    """Simulated GPUs if asked; else NVML; else a clear error (never a silent simulation)."""
    if simulate:
        return SimulatedGpus.parse(simulate)
    try:
        inv = NvmlGpus()
    except Exception as e:   # pynvml raises NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise RuntimeError(
            f"no NVIDIA GPU found through NVML ({e}); on a machine without GPUs start the "
            "daemon with --simulate-gpus 2x80GiB"
        ) from None
    if inv.count == 0:
        raise RuntimeError("NVML reports no GPU; start with --simulate-gpus 2x80GiB to simulate some")
    return inv
