"""Park device memory in host RAM and bring it back into the very same tensor objects.

Parking works on storages, not tensors: every attached device tensor's storage (for a wrapper
subclass such as DTensor, its inner tensors' storages: see `reach`) is copied to a host buffer
from the process's pool (`pinned`: exact-size, pinned, reused across parks) and then resized to
zero bytes, which hands its memory back to the caching allocator; cuBLAS workspaces are dropped
and `empty_cache` returns it all to the driver. Unparking resizes each storage back and copies
the bytes in. Tensor objects, their storages, views sharing a storage and tied weights all stay
the same Python objects, so optimizer param groups, hooks and user variables remain valid (FSDP
frees parameters this way). Device addresses do change: what holds them (a CUDA graph) makes a
RAM park refused (`ParkRefused`), see docs/runtime.md.

A storage that cannot be resized (memory torch does not own: `torch.load` results, NumPy or
DLPack imports) is parked by pointing each of its tensors at an empty placeholder (`t.data = ...`,
as `nn.Module._apply` does) and, on unpark, at one fresh storage holding the bytes; the tensor
objects still stay the same, only that storage object is new.

Only the devices the attached tensors live on are synchronised or touched; a GPU the job never
used gets no CUDA context from the runtime (under torchrun or Slurm each one would cost ~0.5 GiB).

Under a simulated GPU (`GPUSWAP_SIMULATED_GPU=1`) CPU tensors stand for device memory and the
same code runs with device "cpu" and pageable host buffers. A CPU tensor on a zero-byte storage
does not fail as a freed GPU one does (`.to("cpu")` returns it, kernels read out of bounds), so
while released, a simulated park's tensors are guarded in the parking thread (runtime/freedguard.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from gpuswap.runtime import freedguard, pinned, prefault, reach


class ParkRefused(RuntimeError):
    """A RAM park the runtime cannot do safely. `disk_ok`: a disk checkpoint is still safe (the
    process exits; nothing is brought back to changed addresses)."""

    def __init__(self, reason: str, disk_ok: bool) -> None:
        super().__init__(reason)
        self.disk_ok = disk_ok


@dataclass
class _Slot:
    storage: Any  # torch.UntypedStorage of the device tensor(s); None once a fixed one is freed
    host: Any  # 1-D uint8 host tensor holding its bytes
    nbytes: int
    device: Any
    resizable: bool
    # tensors on a non-resizable storage, each with its (offset, size, stride) view of it
    users: list[tuple[Any, tuple[int, Any, Any]]] = field(default_factory=list)


@dataclass
class RamPark:
    """Host copies of parked device storages, keyed by the storage's C pointer (`_cdata`)."""

    slots: dict[int, _Slot] = field(default_factory=dict)
    nbytes: int = 0
    pinned: bool = False
    released: bool = False
    keep_device: bool = False   # copies only: device memory stays (a disk park with CUDA graphs)
    guarded: bool = False       # simulated GPUs: its freed storages are guarded (freedguard.py)
    lease: Optional[pinned.Lease] = None
    pool: Optional[pinned.HostPool] = None

    def host_view(self, t: Any) -> Any | None:
        """A CPU tensor viewing `t`'s bytes in the host copy, or None if `t` is not parked here.
        A wrapper subclass is rebuilt around host views of its inner tensors."""
        import torch

        if reach.is_wrapper(t):
            return self._wrapper_view(t)
        try:
            slot = self.slots.get(t.untyped_storage()._cdata)
        except Exception:
            return None
        if slot is None:
            return None
        return torch.empty(0, dtype=t.dtype).set_(
            slot.host.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )

    def _wrapper_view(self, t: Any) -> Any | None:
        import torch

        names, ctx = t.__tensor_flatten__()
        inner = {}
        for name in names:
            x = getattr(t, name)
            if isinstance(x, torch.Tensor):
                x = self.host_view(x)
                if x is None:
                    return None
            inner[name] = x
        try:
            out = type(t).__tensor_unflatten__(inner, ctx, t.size(), t.stride())
        except Exception:
            return None  # the caller copies it (`.cpu()`) instead
        return out if out.device.type == "cpu" else None


def is_device(t: Any, simulated: bool) -> bool:
    return t.device.type == "cpu" if simulated else t.is_cuda


def device_bytes(tensors: Iterable[Any], simulated: bool) -> int:
    """Bytes of device memory held by these tensors, each storage counted once (a wrapper's inner
    tensors counted; one whose memory cannot be reached, by its elements)."""
    return reach.device_bytes(tensors, simulated)


def _byte_view(storage: Any) -> Any:
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(devices: Iterable[Any]) -> None:
    import torch

    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _device_guard(device: Any) -> Any:
    """Allocate on the storage's own device (older torch resized on the current device)."""
    import contextlib

    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _refusal(found: reach.Survey, simulated: bool, tier: str) -> Optional[str]:
    """Why device addresses must stay put (CUDA graphs), after refusing what cannot be reached."""
    if tier == "ram" and found.unreachable:
        more = len(found.unreachable) - 3
        raise ParkRefused(
            "cannot reach the device memory of " + "; ".join(found.unreachable[:3])
            + (f"; and {more} more" if more > 0 else "")
            + ": only plain tensors and traceable wrapper subclasses (__tensor_flatten__) can be "
            "parked, and a partial park would not free what the scheduler counts on", disk_ok=False)
    graphs = None if simulated else reach.graph_pools()
    if graphs and tier == "ram":
        raise ParkRefused(graphs, disk_ok=True)
    return graphs


def copy_to_host(tensors: Iterable[Any], simulated: bool, tier: str = "ram",
                 pool: Optional[pinned.HostPool] = None) -> RamPark:
    """Copy every device storage to host. Device memory is still in use afterwards.

    `tier="ram"` raises ParkRefused for what cannot be parked safely. `tier="disk"` copies what
    it can reach for the checkpoint; with a CUDA graph the device memory is then kept
    (`keep_device`): the process exits after the checkpoint, and if writing it fails the job runs
    on at the addresses its graphs know."""
    found = reach.survey(tensors, simulated)
    graphs = _refusal(found, simulated, tier)
    park = RamPark(keep_device=graphs is not None)
    entries = list(found.storages.items())
    if not entries:
        return park
    devices = found.devices
    _synchronize(devices)  # kernels on side streams must be done before we read their outputs
    park.pool = pool or pinned.pool_for(simulated)
    cuda = sorted(d.index for d in devices if d.type == "cuda")
    # prepared when the pause was asked, if it is what this park needs (runtime/prefault.py)
    park.lease = prefault.take(park.pool, [e.nbytes for _, e in entries], cuda[0] if cuda else None)
    try:
        for i, host in park.lease.buffers():
            key, e = entries[i]
            host.copy_(_byte_view(e.storage), non_blocking=True)
            users = [(u, (u.storage_offset(), u.size(), u.stride())) for u in e.users]
            park.slots[key] = _Slot(e.storage, host, e.nbytes, e.device, e.resizable, users)
            park.nbytes += e.nbytes
        _synchronize(devices)
    except BaseException:
        try:
            _synchronize(devices)  # no copy may still be writing into buffers the pool takes back
        finally:
            drop_host(park)
        raise
    park.pinned = park.lease.pinned
    return park


def _retarget(t: Any, storage: Any, like: tuple[int, Any, Any]) -> None:
    """Point tensor `t` (same object) at `storage` with the given offset, size and stride."""
    import torch

    offset, size, stride = like
    t.data = torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage, offset, size, stride)


def _free(slot: _Slot) -> None:
    if slot.resizable:
        slot.storage.resize_(0)
        return
    import torch

    for u, _ in slot.users:
        u.data = torch.empty(0, dtype=u.dtype, device=u.device)


def empty_device_cache(simulated: bool) -> None:
    """Return freed memory to the driver: cuBLAS/cuBLASLt workspaces first (torch keeps one per
    handle and stream in the caching allocator; `_cuda_clearCublasWorkspaces` drops both maps),
    then the allocator's cache. Neither is a CUDA call on a device without allocations."""
    if simulated:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def release(park: RamPark, simulated: bool) -> None:
    """Free the device memory of parked storages. All or nothing: on failure, undo and raise."""
    if park.keep_device:
        return
    done: list[_Slot] = []
    try:
        for slot in park.slots.values():
            _free(slot)
            done.append(slot)
    except Exception:
        _refill(done)
        raise
    for slot in park.slots.values():
        if not slot.resizable:
            slot.storage = None  # the last reference: its memory goes now
    park.released = True
    if simulated:
        park.guarded = freedguard.arm(park)      # reading a freed tensor fails, as on a GPU
    empty_device_cache(simulated)


def _refill(slots: list[_Slot]) -> None:
    import torch

    devices = set()
    for slot in slots:
        with _device_guard(slot.device):
            if slot.resizable:
                if slot.storage.nbytes() != slot.nbytes:
                    slot.storage.resize_(slot.nbytes)
                _byte_view(slot.storage).copy_(slot.host, non_blocking=True)
            else:
                if slot.storage is None:
                    fresh = torch.empty(slot.nbytes, dtype=torch.uint8, device=slot.device)
                    fresh.copy_(slot.host, non_blocking=True)
                    slot.storage = fresh.untyped_storage()
                for u, like in slot.users:
                    _retarget(u, slot.storage, like)
        devices.add(slot.device)
    _synchronize(devices)


def restore(park: RamPark, simulated: bool) -> float:
    """Bring parked bytes back into the original storages; returns seconds taken.

    If device memory cannot be had (another process took it), frees what was restored again and
    raises, leaving the job parked so that a later resume can retry.
    """
    t0 = time.perf_counter()
    if not park.released:
        return 0.0
    if park.guarded:
        freedguard.disarm(park)   # the refill writes into the freed storages
        park.guarded = False
    try:
        _refill(list(park.slots.values()))
    except Exception:
        for slot in park.slots.values():
            if slot.resizable:
                slot.storage.resize_(0)
            else:
                _free(slot)
                slot.storage = None
        if simulated:
            park.guarded = freedguard.arm(park)
        empty_device_cache(simulated)
        raise
    park.released = False
    return time.perf_counter() - t0


def leave_on_host(park: RamPark, tensors: Iterable[Any]) -> int:
    """Point every parked tensor whose device memory was freed at its bytes in the host copy (a
    CPU tensor, same object, same view); how many were moved. For a process about to exit after
    a spill (a RAM park later written to disk): the unwinding runs the job's own code, and on an
    H100 Lightning's teardown (`_optimizers_to_device(cpu)`) failed with "CUDA error: invalid
    argument" on a freed tensor, exit 1 instead of 75. The device memory cannot come back (the
    GPU is someone else's now), so the tensors leave on the host, whole. Training thread only."""
    if not park.released:
        return 0
    import torch

    moved = 0
    for slot in park.slots.values():      # freed by pointing each user at a placeholder
        if not slot.resizable:
            for u, (offset, size, stride) in slot.users:
                u.data = torch.empty(0, dtype=u.dtype).set_(slot.host.untyped_storage(), offset, size, stride)
                moved += 1
    for t in tensors:
        for leaf in reach.leaves(t):
            view = park.host_view(leaf)     # resized to zero: still their storage, looked up by it
            if view is not None:
                leaf.data = view
                moved += 1
    return moved


def drop_host(park: RamPark) -> None:
    """Forget the host copies: their buffers go back to the pool, which unpins and frees them
    later on its own thread (never inside a timed resume). A simulated park's guard goes with them."""
    if park.guarded:
        freedguard.disarm(park)
        park.guarded = False
    park.slots.clear()
    if park.pool is not None:
        park.pool.give_back(park.lease)
    park.lease = None
