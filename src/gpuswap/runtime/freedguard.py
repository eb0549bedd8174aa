"""Simulated GPUs only: reading a tensor whose device memory a RAM park freed fails, as on a GPU.

On a real GPU a parked storage is resized to zero bytes (parking.release): its data pointer is
gone, and whatever reads or writes the tensor's bytes fails. Observed on an H100: Lightning's
teardown after a spill (`_optimizers_to_device(cpu)`, i.e. `t.to("cpu")` on a freed optimizer
tensor) raised `RuntimeError: CUDA error: invalid argument` and the job exited 1, not 75 (the
defect `parking.leave_on_host` fixed). The simulated GPU hid it: there the "device" tensor is a
CPU tensor, `t.to("cpu")` of it returns it untouched, and CPU kernels on a zero-byte storage
read out of bounds (`t.sum()`, `t.clone()` segfault on torch 2.13) instead of raising.

So while a simulated RAM park's storages are freed, the thread that parked them (the training
thread: pausing.serve and RankJob._carry_out call release and restore there) runs with `Guard`
on its torch-function mode stack. Any torch function or Tensor method given a tensor on a freed
storage (identified by storage identity, `untyped_storage()._cdata`, the RamPark's slot keys)
raises RuntimeError("CUDA error: invalid argument (...)"), unless it only reads metadata or makes
a view (`_PASS`): shape, dtype, device, size/stride/numel, data_ptr, untyped_storage, hash,
property getters and setters (`.data = x`), `.view`, `.t()`, `*_like` factories. Views are left
to torch itself: one that goes through as_strided (`t[1]`, `narrow`) fails its storage bounds
check ("setStorage: ... out of bounds for storage of size 0"), a device-independent ATen check,
so CPU and CUDA agree. The message is the one the H100 gave for a copy off the device (a
cudaMemcpy from a freed pointer); for a kernel reading it a real GPU would more likely report an
illegal memory access, asynchronously: inferred, not observed. Either way the job fails there.
`reshape`/`flatten`/`contiguous` pass only on a contiguous tensor (a view); otherwise they copy.

Torch function modes are per thread (`static thread_local PythonTorchFunctionTLS` in
aten/src/ATen/PythonTorchFunctionTLS.cpp), so other threads of the job (data loaders, the
runtime's reader) are neither slowed nor guarded. The guard goes below every mode already there
but `torch.set_default_device`'s (a DeviceContext whose own `__enter__` ran, torch/utils/_device.py:
its `__exit__` asserts it is at the bottom). A mode's `__exit__` pops the top of the stack,
whatever it is (TorchFunctionMode, and `with torch.device(...)`, whose C++ pushes and pops a
DeviceContext on top: checked on torch 2.13), so a user's `with` that exits while the park is
still freed (a spill's SystemExit unwinding) pops its own mode, not ours. `disarm` takes ours
out wherever it is and leaves the rest in order.

What it cannot see (said rather than pretended): code that reaches the bytes below the Python
API: storage methods (`t.untyped_storage().tolist()`, pickling and torch.save, which read
storages), C++ (the autograd engine's saved tensors, DDP's Reducer, extensions), ops run under
`torch._C.DisableTorchFunction`, and other threads. On a real GPU most of those fail too.

Lifetime: armed by parking.release, disarmed by parking.restore before its refill (and armed again
if the refill fails and frees everything again) and by parking.drop_host. A spill never restores:
the guard stays through the exit, where what leave_on_host did not re-point (a view the job kept
but did not attach) fails as on a GPU. Never used for real GPUs: no mode, no cost.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Iterable

MESSAGE = "CUDA error: invalid argument (simulated GPU: this tensor's device memory was freed by a RAM park)"

# Functions and methods that read no tensor data (metadata, views, templates), by __name__.
_PASS = frozenset("""
    size stride dim ndimension numel nelement element_size storage_offset data_ptr untyped_storage
    storage _typed_storage is_contiguous is_floating_point is_complex is_signed get_device is_set_to
    is_same_size is_shared is_pinned is_inference is_conj is_neg has_names dim_order _is_view
    __len__ __dlpack_device__ requires_grad_ retain_grad register_hook
    register_post_accumulate_grad_hook detach detach_ alias _make_subclass
    view view_as unflatten squeeze unsqueeze transpose swapaxes swapdims t permute movedim moveaxis
    expand expand_as narrow select split chunk unbind diagonal as_strided unfold view_as_real
    view_as_complex
    empty_like zeros_like ones_like full_like rand_like randn_like randint_like new_empty
    new_zeros new_ones new_full new_empty_strided
""".split())
_IF_CONTIGUOUS = frozenset({"reshape", "reshape_as", "flatten", "contiguous"})
_DESCRIPTOR = frozenset({"__get__", "__set__", "__delete__"})   # property getters and setters


def _basic_index(index: Any) -> bool:
    """Indexing with ints, slices, None and ... only: a view (torch's bounds check decides)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


@functools.lru_cache(maxsize=None)
def _guard_class() -> Any:
    """The mode's class, made on first use (torch is imported only when a simulated park frees)."""
    from torch.overrides import TorchFunctionMode

    class Guard(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.parks: dict[int, dict[int, Any]] = {}   # id(park) -> {storage key: storage}
            self.keys: frozenset[int] = frozenset()

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if self.keys and not _passes(func, args) and any(_key(t) in self.keys
                                                             for t in _tensors((args, kwargs))):
                raise RuntimeError(MESSAGE)
            return func(*args, **kwargs)

        def rekey(self) -> None:
            self.keys = frozenset(k for slots in self.parks.values() for k in slots)

    return Guard


def _passes(func: Any, args: Any) -> bool:
    """Whether `func` reads no tensor data (`_PASS`, or a view in the cases that are one)."""
    name = getattr(func, "__name__", "")
    if name in _PASS or name in _DESCRIPTOR:
        return True
    if name in _IF_CONTIGUOUS:
        return bool(args) and _is_contiguous(args[0])
    if name == "__getitem__":
        return len(args) > 1 and _basic_index(args[1])
    if name == "type":                      # t.type() names it; t.type(x) converts
        return len(args) == 1
    return False


def _is_contiguous(t: Any) -> bool:
    try:
        return bool(t.is_contiguous())
    except Exception:
        return False


def _key(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:          # sparse, nested, a wrapper without storage
        return None


def _tensors(value: Any, depth: int = 0) -> Iterable[Any]:
    """The plain tensors in args/kwargs (lists of them for _foreach_ ops; a wrapper subclass by
    the inner tensors holding its memory, as parking reaches them)."""
    import torch

    from gpuswap.runtime import reach

    if isinstance(value, torch.Tensor):
        yield from reach.leaves(value)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)


_local = threading.local()   # this thread's guard, if it has one


def current() -> Any:
    """This thread's guard (None if it never armed one): for tests and for a look while parked."""
    return getattr(_local, "guard", None)


def arm(park: Any) -> bool:
    """Guard the storages `park` freed (its resizable slots; the others' tensors were pointed at
    empty placeholders, which are as empty on a GPU); whether there were any. Call in the thread
    that will wait parked."""
    freed = {k: s.storage for k, s in park.slots.items() if s.resizable and s.storage is not None}
    if not freed:
        return False
    guard = current()
    if guard is None:
        guard = _local.guard = _guard_class()()
    guard.parks[id(park)] = freed        # the storages are kept: their keys cannot be reused
    guard.rekey()
    if not _on_stack(guard):
        _insert(guard)
    return True


def disarm(park: Any) -> None:
    """Stop guarding `park`'s storages (they are about to be refilled, or forgotten). The mode
    leaves this thread's stack with its last park; from another thread only the keys go."""
    guard = current()
    if guard is None or guard.parks.pop(id(park), None) is None:
        return
    guard.rekey()
    if not guard.parks and _on_stack(guard):
        _remove(guard)


def _stack() -> list[Any]:
    import torch

    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _on_stack(guard: Any) -> bool:
    return any(m is guard for m in _stack())


def _insert(guard: Any) -> None:
    """Put `guard` below every mode on the stack but the default-device contexts at its bottom."""
    import torch
    from torch.utils._device import DeviceContext

    modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    modes.reverse()                                          # bottom first
    at = 0
    while at < len(modes) and isinstance(modes[at], DeviceContext) and hasattr(modes[at], "old_device"):
        at += 1
    modes.insert(at, guard)
    for m in modes:
        torch._C._push_on_torch_function_stack(m)


def _remove(guard: Any) -> None:
    """Take `guard` off the stack; the modes above it go back in their order."""
    import torch

    above = []
    while torch._C._len_torch_function_stack():
        m = torch._C._pop_torch_function_stack()
        if m is guard:
            break
        above.append(m)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)
