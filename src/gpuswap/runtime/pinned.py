"""Host buffers for parked device memory: exact size, pinned, reused across parks, released off
the critical path.

Why not `torch.empty(pin_memory=True)`: torch's caching host allocator rounds each block up to a
power of two (a 9 GiB park would hold 16 GiB of host RAM, beyond what the daemon's RAM budget
counts), a fresh multi-GiB `cudaHostAlloc` takes seconds at every park, and cached blocks go
back to the OS only through `empty_host_cache` (absent from older torch), whose `cudaFreeHost`
would then sit inside the timed resume.

Here a park asks for one buffer per device storage. Buffers are carved out of slabs: anonymous
mmap regions of exactly the bytes placed in them (64-byte aligned, rounded up to a page),
faulted in by worker threads, then registered with `cudaHostRegister` so the copies run at full
PCIe speed (`_fault_in` says why in that order). Slabs left idle by an
earlier park are filled first (largest storage first, first fit); what does not fit goes into new
slabs, which worker threads map and pin while the first copies already run. A layout that would
hold more than `MAX_OVERHEAD` times the parked bytes (an old slab much larger than this park
needs) is dropped for a fresh, exact one.

Release: when a park is over (resumed, or failed) its slabs become idle. An idle slab is unpinned
and unmapped by a background thread `keep_s` seconds later (`GPUSWAP_PINNED_KEEP_S`, default 30;
0 releases right after the resume returns), or as soon as a park does not need it. Pinned RAM of
a running job is outside the daemon's RAM budget, so the window is short: it serves a job parked
again soon (a resume that failed, a policy that flips), not a job that runs for hours.

Every CUDA call here runs on a worker or the release thread, never the training thread, under a
guard for a device the job already uses: a new thread's current device is 0, and the runtime must
not create a context on a GPU the job never touched (nor leave a failed call's error for the
training thread's next kernel launch to report).

A job's first park need not find the pool cold: runtime/prefault.py takes its lease when the pause
is asked, while the step still runs. A slab that cannot be pinned stays pageable: the park works, only slower (`Lease.notes` says
why). Under a simulated GPU no pinner is given and the same layout, reuse and release run on
pageable memory.
"""
from __future__ import annotations

import atexit
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Protocol

from gpuswap.protocol.env import PINNED_KEEP_S

ALIGN = 64                  # each buffer's offset in its slab (any dtype's alignment)
PAGE = mmap.PAGESIZE
SLAB_BYTES = 256 << 20      # a new slab holds at most this much, unless one storage is larger:
                            # small enough that copies start early and several pin at once
MAX_OVERHEAD = 1.25         # host bytes a layout may hold per parked byte before it is redone fresh
DEFAULT_KEEP_S = 30.0
MAX_KEEP_S = 3600.0
# Faulting in and pinning fresh pages is CPU work (the kernel zeroes each page); the training
# thread is blocked in the park meanwhile, so the job's CPUs are free to do it in parallel.
PIN_WORKERS = min(8, max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2))
CUDA_HOST_REGISTER_PORTABLE = 1   # pinned for every context of the process, as torch's own helper


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def keep_seconds(env: Any = os.environ) -> float:
    """How long an idle slab is kept, from `GPUSWAP_PINNED_KEEP_S` (0 to 3600; default 30)."""
    try:
        value = float(env.get(PINNED_KEEP_S, DEFAULT_KEEP_S))
    except (TypeError, ValueError):
        return DEFAULT_KEEP_S
    return min(max(value, 0.0), MAX_KEEP_S) if value == value else DEFAULT_KEEP_S


class Pinner(Protocol):
    """Page-locks host memory for DMA (the real one is CUDA's; tests stand in for absent GPUs)."""

    def pin(self, ptr: int, nbytes: int, device: Optional[int]) -> Optional[str]:
        """None once pinned, else why not (the memory stays usable, pageable)."""

    def unpin(self, ptr: int, device: Optional[int]) -> None: ...


class CudaPinner:
    """`cudaHostRegister`/`cudaHostUnregister` through torch's own binding, `torch.cuda.cudart()`
    (torch/csrc/cuda/shared/cudart.cpp: `(ptr, size, flags) -> cudaError`, GIL released)."""

    def pin(self, ptr: int, nbytes: int, device: Optional[int]) -> Optional[str]:
        import torch

        try:
            with torch.cuda.device(device):
                err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
        except Exception as exc:  # no runtime binding in this torch, or CUDA refused outright
            return f"cudaHostRegister unavailable: {type(exc).__name__}: {exc}"
        return None if err == 0 else f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})"

    def unpin(self, ptr: int, device: Optional[int]) -> None:
        import torch

        try:
            with torch.cuda.device(device):
                torch.cuda.cudart().cudaHostUnregister(ptr)
        except Exception:
            pass  # the process is ending or the context is gone: the OS reclaims the pages


@dataclass(eq=False)
class Slab:
    """One mmap region. Buffers handed out keep `mem` alive, so unmapping waits for the last one."""

    mem: Any  # mmap.mmap; never closed by hand (a live buffer would point at unmapped memory)
    size: int
    ptr: int
    device: Optional[int]
    pinned: bool
    why_not: Optional[str] = None
    idle_since: float = 0.0

    def buffer(self, offset: int, nbytes: int) -> Any:
        """A 1-D uint8 CPU tensor on its own storage (torch.save then writes just these bytes)."""
        import torch

        return torch.frombuffer(self.mem, dtype=torch.uint8, count=nbytes, offset=offset)


def _new_slab(size: int, pinner: Optional[Pinner], device: Optional[int]) -> Slab:
    import torch

    mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A forked child (a DataLoader worker) must not share pages the GPU DMAs into. No
    # MADV_HUGEPAGE: with the kernel's default THP defrag ("madvise") it makes each fault compact
    # memory directly, which made first-touching 1 GiB 3-5x slower on a loaded host.
    if hasattr(mmap, "MADV_DONTFORK"):
        try:
            mem.madvise(mmap.MADV_DONTFORK)
        except OSError:
            pass
    ptr = torch.frombuffer(mem, dtype=torch.uint8, count=1).data_ptr()
    _fault_in(mem)
    why = pinner.pin(ptr, size, device) if pinner is not None else "simulated GPU: pageable memory"
    return Slab(mem, size, ptr, device, pinned=why is None, why_not=why)


def _fault_in(mem: Any) -> None:
    """Write one byte per page, so the pages exist before `cudaHostRegister` pins them.

    Registering untouched memory makes the driver fault every page in itself, one thread at a
    time whatever the number of callers: on an H100 host (Firecracker VM, 16 cores, 4 GiB) that
    ran at 3.6 GB/s with 1 or 16 threads, while 8 threads faulting the same bytes in ran at 13 GB/s
    and registering memory already faulted in ran at 20-31 GB/s (1-16 threads). torch's fill
    releases the GIL, so the pool's workers fault their slabs in side by side."""
    import torch

    torch.frombuffer(mem, dtype=torch.uint8)[::PAGE].fill_(0)


@dataclass(frozen=True)
class Layout:
    """Where each requested buffer goes: (slab number, byte offset). Numbers below `first_new`
    are reused slabs (indices into `reusable`), `first_new + j` is `new_sizes[j]`."""

    spots: list[tuple[int, int]]
    new_sizes: list[int]
    reused: frozenset[int]
    host_bytes: int
    first_new: int


def layout(sizes: list[int], reusable: list[int], slab_bytes: int = SLAB_BYTES) -> Layout:
    """First fit, largest first, into the reusable slabs; the rest packed in order into new
    slabs of at most `slab_bytes` (a larger storage gets a slab of its own), each exactly the
    aligned bytes it holds, rounded up to a page. Redone without reuse if that holds more than
    MAX_OVERHEAD times the bytes asked for."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    fill = [0] * len(reusable)
    spots: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    rest: list[int] = []
    for i in order:
        need = _round(sizes[i], ALIGN)
        for k, cap in enumerate(reusable):
            if cap - fill[k] >= need:
                spots[i] = (k, fill[k])
                fill[k] += need
                break
        else:
            rest.append(i)
    new_sizes: list[int] = []
    used = 0
    for i in rest:
        need = _round(sizes[i], ALIGN)
        if not new_sizes or (used and used + need > slab_bytes):
            if new_sizes:
                new_sizes[-1] = _round(used, PAGE)
            new_sizes.append(0)
            used = 0
        spots[i] = (len(reusable) + len(new_sizes) - 1, used)
        used += need
    if new_sizes:
        new_sizes[-1] = _round(used, PAGE)
    reused = frozenset(k for k in range(len(reusable)) if fill[k])
    host = sum(reusable[k] for k in reused) + sum(new_sizes)
    if reused and host > MAX_OVERHEAD * sum(sizes):
        return layout(sizes, [], slab_bytes)
    return Layout(spots, new_sizes, reused, host, len(reusable))


class Lease:
    """Buffers for one park. `buffers()` yields them slab by slab as each slab is ready (reused
    ones at once, new ones once mapped and pinned), so copies start before the last pin ends."""

    def __init__(self, sizes: list[int], slabs: list["Slab | Future[Slab]"], spots: list[tuple[int, int]]):
        self.sizes = sizes
        self._slabs = slabs
        self._spots = spots

    def buffers(self) -> Iterator[tuple[int, Any]]:
        """(request index, 1-D uint8 host tensor) for every requested size."""
        by_slab: dict[int, list[int]] = {}
        for i, (k, _) in enumerate(self._spots):
            by_slab.setdefault(k, []).append(i)
        for k in sorted(by_slab):
            slab = self._slab(k)
            for i in by_slab[k]:
                yield i, slab.buffer(self._spots[i][1], self.sizes[i])

    def _slab(self, k: int) -> Slab:
        s = self._slabs[k]
        return s.result() if isinstance(s, Future) else s

    def settled(self) -> list[Slab]:
        """Every slab that exists (waits for pins still under way; failed ones are skipped)."""
        out = []
        for s in self._slabs:
            try:
                out.append(s.result() if isinstance(s, Future) else s)
            except Exception:
                pass
        return out

    @property
    def pinned(self) -> bool:
        return all(s.pinned for s in self.settled())

    @property
    def notes(self) -> list[str]:
        return sorted({s.why_not for s in self.settled() if s.why_not})

    @property
    def host_bytes(self) -> int:
        return sum(s.size for s in self.settled())


@dataclass
class PoolStats:
    leased_bytes: int = 0
    idle_bytes: int = 0
    slabs_made: int = 0
    slabs_released: int = 0
    pinned_bytes: int = 0  # of the slabs that exist now


class HostPool:
    """The slabs of one process, leased to one park at a time (a job parks once at a time)."""

    def __init__(self, pinner: Optional[Pinner], keep_s: Optional[float] = None,
                 slab_bytes: int = SLAB_BYTES) -> None:
        self.pinner = pinner
        self.keep_s = keep_seconds() if keep_s is None else keep_s
        self.slab_bytes = slab_bytes
        self._cond = threading.Condition()
        self._idle: list[Slab] = []
        self._leased: dict[int, Lease] = {}
        self._retiring: list[Slab] = []
        self._releasing = 0
        self._made = self._released = 0
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        self._workers: Optional[ThreadPoolExecutor] = None

    # -- leasing (training thread) ---------------------------------------------------------
    def take(self, sizes: list[int], device: Optional[int] = None) -> Lease:
        """Buffers of exactly `sizes` bytes (each > 0); new slabs are pinned for `device`'s
        context (one the job already uses)."""
        with self._cond:
            idle, self._idle = self._idle, []
        idle.sort(key=lambda s: -s.size)
        plan = layout(sizes, [s.size for s in idle], self.slab_bytes)
        reused = sorted(plan.reused)
        slabs: list[Slab | Future[Slab]] = [idle[k] for k in reused]
        if plan.new_sizes:
            workers = self._executor()
            slabs += [workers.submit(_new_slab, n, self.pinner, device) for n in plan.new_sizes]
        # plan numbers: reused slabs by their index in `idle`, new ones after them
        where = {k: j for j, k in enumerate(reused)}
        where.update({plan.first_new + j: len(reused) + j for j in range(len(plan.new_sizes))})
        lease = Lease(list(sizes), slabs, [(where[k], off) for k, off in plan.spots])
        with self._cond:
            self._made += len(plan.new_sizes)
            self._leased[id(lease)] = lease
            self._retire([s for k, s in enumerate(idle) if k not in plan.reused])
        return lease

    def give_back(self, lease: Optional[Lease]) -> None:
        """The park is over: its slabs go idle (released after keep_s). Cheap: nothing is
        unpinned or unmapped here, so a timed resume never pays for it."""
        if lease is None:
            return
        slabs = lease.settled()   # pins under way (a park that failed early) finish first
        now = time.monotonic()
        with self._cond:
            if self._leased.pop(id(lease), None) is None:
                return
            for s in slabs:
                s.idle_since = now
            self._idle.extend(slabs)
            self._wake()

    def holds(self, lease: Lease) -> bool:
        """Whether `lease` is still out (not given back)."""
        with self._cond:
            return id(lease) in self._leased

    # -- release (background thread) -------------------------------------------------------
    def release_idle(self) -> None:
        """Release every idle slab now (still on the background thread)."""
        with self._cond:
            self._retire(self._idle)
            self._idle = []

    def wait_released(self, timeout: Optional[float] = None) -> bool:
        """Block until no idle slab is left and no release is under way (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._idle and not self._retiring and not self._releasing, timeout)

    def stats(self) -> PoolStats:
        with self._cond:
            leased = [s for lease in self._leased.values() for s in lease._slabs
                      if isinstance(s, Slab) or (s.done() and s.exception() is None)]
            leased = [s.result() if isinstance(s, Future) else s for s in leased]
            live = leased + self._idle + self._retiring
            return PoolStats(leased_bytes=sum(s.size for s in leased),
                             idle_bytes=sum(s.size for s in self._idle),
                             slabs_made=self._made, slabs_released=self._released,
                             pinned_bytes=sum(s.size for s in live if s.pinned))

    def close(self) -> None:
        """At exit: stop releasing (the process's end returns every page at once)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def _retire(self, slabs: list[Slab]) -> None:  # caller holds the lock
        if slabs:
            self._retiring.extend(slabs)
            self._wake()

    def _wake(self) -> None:  # caller holds the lock
        if self._thread is None:
            self._thread = threading.Thread(target=self._release_loop, name="gpuswap-host-release",
                                            daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _due(self, now: float) -> list[Slab]:
        due = [s for s in self._idle if now - s.idle_since >= self.keep_s]
        if due:
            self._idle = [s for s in self._idle if s not in due]
        due += self._retiring
        self._retiring = []
        return due

    def _release_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closing:
                        return
                    due = self._due(time.monotonic())
                    if due:
                        self._releasing += len(due)
                        break
                    wait = None
                    if self._idle:
                        first = min(s.idle_since for s in self._idle)
                        wait = max(0.0, first + self.keep_s - time.monotonic())
                    self._cond.wait(wait)
            for s in due:
                if s.pinned and self.pinner is not None:
                    self.pinner.unpin(s.ptr, s.device)
                s.pinned = False
                s.mem = None  # unmapped now, or when the last buffer still viewing it goes
            with self._cond:
                self._releasing -= len(due)
                self._released += len(due)
                self._cond.notify_all()

    def _executor(self) -> ThreadPoolExecutor:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(PIN_WORKERS, thread_name_prefix="gpuswap-pin")
        return self._workers


_pools: dict[bool, HostPool] = {}
_pools_lock = threading.Lock()


def pool_for(simulated: bool) -> HostPool:
    """The process's pool: pinned through CUDA, or pageable under a simulated GPU."""
    with _pools_lock:
        pool = _pools.get(simulated)
        if pool is None:
            pool = _pools[simulated] = HostPool(None if simulated else CudaPinner())
            atexit.register(pool.close)
        return pool
