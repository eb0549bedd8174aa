"""Which device memory a park can reach, and what would make parking it unsafe.

Wrapper tensor subclasses (FSDP2/DTensor, Float8, NF4, nested jagged tensors) own no memory of
their own: `untyped_storage()` on them raises or hands back a storage without data. Those that
are *traceable* (`torch.utils._python_dispatch.is_traceable_wrapper_subclass`: they implement
`__tensor_flatten__`/`__tensor_unflatten__`, what torch.compile and FSDP rely on) name their inner
tensors; the park walks those, recursively, and parks their storages like any other. A tensor
whose memory cannot be reached that way (a subclass without `__tensor_flatten__`, a sparse
tensor) cannot be parked: a RAM park is refused with the reason, never half done.

CUDA graphs replay fixed device addresses, and an unpark allocates new ones. A captured graph
keeps its memory in a private pool of the caching allocator, which `torch.cuda.memory_snapshot()`
lists as segments whose `segment_pool_id` is not (0, 0) (user `MemPool`s show the same way). While
any exists, a RAM park is refused (see `graph_pools`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

MAX_DEPTH = 8  # wrappers of wrappers (a DTensor of Float8) are a few levels deep, never more


@dataclass
class Storage:
    """One distinct device storage; for one torch cannot resize, the plain tensors seen on it
    (a park points each of them at a placeholder and back)."""

    storage: Any
    nbytes: int
    device: Any
    resizable: bool
    users: list[Any] = field(default_factory=list)
    user_ids: set[int] = field(default_factory=set)


@dataclass
class Survey:
    storages: dict[int, Storage] = field(default_factory=dict)  # by the storage's `_cdata`
    unreachable: list[str] = field(default_factory=list)        # why a tensor cannot be parked
    unreachable_bytes: int = 0                                  # their size, as far as known

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    @property
    def devices(self) -> set[Any]:
        return {s.device for s in self.storages.values()}


def is_wrapper(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def inner_tensors(t: Any) -> Iterator[tuple[str, Any]]:
    """(attribute, tensor) for a traceable wrapper's inner tensors (DTensor also names its mesh
    in `__tensor_flatten__`: what is not a tensor is skipped)."""
    import torch

    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield name, inner


def _why_unreachable(t: Any) -> Optional[str]:
    import torch

    if t.layout != torch.strided:
        return f"a {t.layout} tensor"
    try:
        st = t.untyped_storage()
        if st.nbytes() and not st.data_ptr():
            return f"a {type(t).__name__} whose storage has no data"
    except Exception as exc:
        return f"a {type(t).__name__} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return None


def _on_device(t: Any, simulated: bool) -> bool:
    return t.device.type == "cpu" if simulated else t.device.type == "cuda"


_PLAIN: frozenset[type] = frozenset()


def _plain(t: Any) -> bool:
    """A plain tensor or parameter: the common case, decided without the wrapper protocol."""
    global _PLAIN
    if not _PLAIN:
        import torch

        _PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
    return type(t) in _PLAIN


def leaves(t: Any) -> Iterator[Any]:
    """`t`, or the inner tensors holding a wrapper subclass's memory."""
    return iter((t,)) if _plain(t) else _unwrapped(t)


def _unwrapped(t: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors holding a wrapper's memory (a non-traceable one stands for itself)."""
    if depth < MAX_DEPTH and not _plain(t) and is_wrapper(t):
        for _, inner in inner_tensors(t):
            yield from _unwrapped(inner, depth + 1)
    else:
        yield t


@dataclass(frozen=True)
class Measured:
    """One walk of the attached tensors: the bytes `device_bytes` reports, and the sizes of the
    distinct non-empty storages in the order `survey` finds them, with the lowest CUDA device
    index among them: what a park will ask the host pool for (runtime/prefault.py prepares it
    when a pause is asked, from another thread that must not walk the tensors itself)."""

    nbytes: int
    sizes: tuple[int, ...] = ()
    device: Optional[int] = None


def measure(tensors: Iterable[Any], simulated: bool) -> Measured:
    """What `survey(...).nbytes + unreachable_bytes` says, cheaply: it runs at every usage
    measurement of a job that may hold many thousands of tensors."""
    seen: dict[int, int] = {}
    extra = 0
    device: Optional[int] = None
    for t in tensors:
        for leaf in [t] if _plain(t) else _unwrapped(t):
            if (leaf.device.type != "cpu") if simulated else not leaf.is_cuda:
                continue
            try:
                st = leaf.untyped_storage()
                key = st._cdata
                if key not in seen and not simulated:
                    index = leaf.device.index
                    device = index if device is None or index < device else device
                seen[key] = st.nbytes()
            except Exception:
                extra += leaf.numel() * leaf.element_size()
    return Measured(sum(seen.values()) + extra, tuple(n for n in seen.values() if n), device)


def device_bytes(tensors: Iterable[Any], simulated: bool) -> int:
    """Device bytes held by `tensors`, each storage once (see `measure`)."""
    return measure(tensors, simulated).nbytes


def _leaves(t: Any, depth: int, out: Survey, simulated: bool) -> None:
    if not _plain(t) and is_wrapper(t):
        if depth >= MAX_DEPTH:
            out.unreachable.append(f"a {type(t).__name__} nested deeper than {MAX_DEPTH} wrappers")
            return
        for _, inner in inner_tensors(t):
            _leaves(inner, depth + 1, out, simulated)
        return
    if not _on_device(t, simulated):
        return
    why = _why_unreachable(t)
    if why is not None:
        out.unreachable.append(f"{why} of shape {tuple(t.shape)} on {t.device}")
        out.unreachable_bytes += t.numel() * t.element_size()
        return
    st = t.untyped_storage()
    entry = out.storages.get(st._cdata)
    if entry is None:
        if st.nbytes() == 0:
            return
        entry = out.storages[st._cdata] = Storage(st, st.nbytes(), st.device, st.resizable())
    if not entry.resizable and id(t) not in entry.user_ids:
        entry.user_ids.add(id(t))
        entry.users.append(t)


def survey(tensors: Iterable[Any], simulated: bool) -> Survey:
    """The device storages behind `tensors` (wrappers unwrapped), each once, and what cannot be
    reached. Never raises for a tensor it does not understand: that is a reason in `unreachable`."""
    out = Survey()
    for t in tensors:
        try:
            _leaves(t, 0, out, simulated)
        except Exception as exc:  # a wrapper whose __tensor_flatten__ fails
            out.unreachable.append(f"a {type(t).__name__} ({type(exc).__name__}: {exc})"[:200])
    return out


def graph_pools() -> Optional[str]:
    """Why device addresses must not change (a CUDA graph or private pool exists), or None.

    Reads the caching allocator's own bookkeeping (no CUDA call, so no device gets a context).
    If the snapshot cannot be had, the answer is "unsafe": a wrong park is worse than none."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception as exc:
        return f"cannot check for CUDA graphs ({type(exc).__name__}: {exc})"
    pools: dict[tuple[Any, Any], int] = {}
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if pool != (0, 0):
            key = (seg.get("device"), pool)
            pools[key] = pools.get(key, 0) + int(seg.get("total_size") or 0)
    if not pools:
        return None
    where = ", ".join(f"{n / 2**20:.0f} MiB on cuda:{dev} (pool {pool[0]},{pool[1]})"
                      for (dev, pool), n in sorted(pools.items(), key=lambda kv: str(kv[0]))[:4])
    return (f"a CUDA graph or private memory pool holds device memory ({where}); it replays fixed "
            "device addresses and an unpark moves tensors to new ones")
