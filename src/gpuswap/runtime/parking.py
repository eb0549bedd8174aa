"""Park device memory in host RAM and bring it back into the very same tensor objects.

Parking works on storages, not tensors: every attached device tensor's storage is copied to a
host buffer (pinned when it is CUDA memory, so copies run at full PCIe speed) and then resized to
zero bytes, which hands its memory back to the caching allocator (then `empty_cache` returns it
to the driver). Unparking resizes the storage back and copies the bytes in. Tensor objects,
their storages, views sharing a storage and tied weights all stay the same Python objects, so
optimizer param groups, hooks and user variables remain valid (FSDP frees parameters this way).

A storage that cannot be resized (memory torch does not own: `torch.load` results, NumPy or
DLPack imports) is parked by pointing each of its tensors at an empty placeholder (`t.data = ...`,
as `nn.Module._apply` does) and, on unpark, at one fresh storage holding the bytes; the tensor
objects still stay the same, only that storage object is new.

Under a simulated GPU (`GPUSWAP_SIMULATED_GPU=1`) CPU tensors stand for device memory and the
same code runs with device "cpu".
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable


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

    def host_view(self, t: Any) -> Any | None:
        """A CPU tensor viewing `t`'s bytes in the host copy, or None if `t` is not parked here."""
        import torch

        slot = self.slots.get(t.untyped_storage()._cdata)
        if slot is None:
            return None
        return torch.empty(0, dtype=t.dtype).set_(
            slot.host.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )


def is_device(t: Any, simulated: bool) -> bool:
    return t.device.type == "cpu" if simulated else t.is_cuda


def device_bytes(tensors: Iterable[Any], simulated: bool) -> int:
    """Bytes of device memory held by these tensors, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if is_device(t, simulated):
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _byte_view(storage: Any) -> Any:
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(devices: set[Any]) -> None:
    import torch

    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def _sync_all_cuda() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _device_guard(device: Any) -> Any:
    """Allocate on the storage's own device (older torch resized on the current device)."""
    import contextlib

    import torch

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _host_buffer(nbytes: int, pin: bool) -> tuple[Any, bool]:
    import torch

    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError:  # pinned memory exhausted/limited: pageable still works, slower
            pass
    return torch.empty(nbytes, dtype=torch.uint8), False


def copy_to_host(tensors: Iterable[Any], simulated: bool) -> RamPark:
    """Copy every device storage to host. Device memory is still in use afterwards."""
    park = RamPark(pinned=not simulated)
    if not simulated:
        _sync_all_cuda()  # kernels on side streams must be done before we read their outputs
    devices = set()
    for t in tensors:
        if not is_device(t, simulated):
            continue
        st = t.untyped_storage()
        key = st._cdata
        slot = park.slots.get(key)
        if slot is None:
            if st.nbytes() == 0:
                continue
            host, pinned = _host_buffer(st.nbytes(), pin=not simulated)
            park.pinned = park.pinned and pinned
            host.copy_(_byte_view(st), non_blocking=True)
            slot = park.slots[key] = _Slot(st, host, st.nbytes(), st.device, st.resizable())
            park.nbytes += st.nbytes()
            devices.add(st.device)
        if not slot.resizable and not any(u is t for u, _ in slot.users):
            slot.users.append((t, (t.storage_offset(), t.size(), t.stride())))
    _synchronize(devices)
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


def _empty_device_cache(simulated: bool) -> None:
    if simulated:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def release(park: RamPark, simulated: bool) -> None:
    """Free the device memory of parked storages. All or nothing: on failure, undo and raise."""
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
    _empty_device_cache(simulated)


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
    try:
        _refill(list(park.slots.values()))
    except Exception:
        for slot in park.slots.values():
            if slot.resizable:
                slot.storage.resize_(0)
            else:
                _free(slot)
                slot.storage = None
        _empty_device_cache(simulated)
        raise
    park.released = False
    return time.perf_counter() - t0


def drop_host(park: RamPark) -> None:
    """Forget the host copies; return cached pinned memory to the OS where torch allows it."""
    park.slots.clear()
    if park.pinned:
        import torch

        empty_host = getattr(getattr(torch, "accelerator", None), "memory", None)
        fn = getattr(empty_host, "empty_host_cache", None)
        if fn is not None and torch.cuda.is_available():
            try:
                fn()
            except Exception:
                pass
