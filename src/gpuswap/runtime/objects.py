"""What `attach` was given: classify objects, find their tensors, save and restore their state.

Only this module and `parking` know about torch types; both import torch lazily, since a job
that attaches torch objects has necessarily imported torch already.
"""
from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

KINDS = ("module", "optimizer", "stateful", "tensor", "generator", "dict", "list")
# Immutable values (an epoch, a seed, a name): nothing can be restored into them in place, so
# `attach` keeps them in `job.state` under their attach name instead (see `is_plain`).
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)


@dataclass(frozen=True)
class Attached:
    """One object handed to `attach`, under the name it is checkpointed as."""

    name: str
    obj: Any
    kind: str


def is_plain(obj: Any, depth: int = 0) -> bool:
    """An immutable plain value: None, a bool, number, str or bytes, or a tuple/frozenset of them."""
    if isinstance(obj, PLAIN_TYPES):
        return True
    if depth < 4 and isinstance(obj, (tuple, frozenset)):
        return all(is_plain(v, depth + 1) for v in obj)
    return False


def classify(name: str, obj: Any) -> Attached:
    """Decide how an attached object is parked and checkpointed; reject what cannot be restored.

    Needs no import: without torch in sys.modules no object can be a torch one, so `attach`
    runs this outside gpuswap too and a script is refused the same way everywhere."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(obj, torch.Tensor):
            return Attached(name, obj, "tensor")
        if isinstance(obj, torch.Generator):
            return Attached(name, obj, "generator")
        if isinstance(obj, torch.nn.Module):
            return Attached(name, obj, "module")
        if isinstance(obj, torch.optim.Optimizer):
            return Attached(name, obj, "optimizer")
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return Attached(name, obj, "stateful")  # LR schedulers, GradScaler, user objects
    if isinstance(obj, dict):
        return Attached(name, obj, "dict")
    if isinstance(obj, list):
        return Attached(name, obj, "list")
    raise TypeError(
        f"gpuswap.attach: cannot checkpoint {name}={type(obj).__name__!r}; pass torch modules, "
        "optimizers, schedulers, grad scalers, tensors, generators, dicts, lists, objects with "
        "state_dict/load_state_dict, or plain values (numbers, strings, None, tuples of them), "
        "which are kept in job.state"
    )


def _walk(value: Any, depth: int = 0) -> Iterator[Any]:
    """Tensors inside nested dicts/lists/tuples (not inside arbitrary objects)."""
    torch = sys.modules["torch"]
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, dict):
        for v in list(value.values()):
            yield from _walk(v, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in list(value):
            yield from _walk(v, depth + 1)


def iter_tensors(items: list[Attached]) -> Iterator[Any]:
    """Every tensor the attached objects own: parameters, gradients, buffers, optimizer state."""
    if "torch" not in sys.modules:
        return
    for a in items:
        if a.kind == "module":
            for p in a.obj.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from a.obj.buffers()
        elif a.kind == "optimizer":
            for group in a.obj.param_groups:
                for p in group["params"]:
                    yield p
                    if p.grad is not None:
                        yield p.grad
            for st in list(a.obj.state.values()):
                yield from _walk(st)
            # ZeroRedundancyOptimizer keeps its shard's state (Adam's moments) in a local optimizer
            # of its own (`optim`); its own `state` is empty, so without this the shard stays on
            # the GPU through a RAM park.
            inner = getattr(a.obj, "optim", None)
            if isinstance(inner, sys.modules["torch"].optim.Optimizer) and inner is not a.obj:
                for st in list(inner.state.values()):
                    yield from _walk(st)
        elif a.kind == "tensor":
            yield a.obj
            if a.obj.grad is not None:
                yield a.obj.grad
        elif a.kind == "stateful":
            yield from _walk(list(vars(a.obj).values()))  # e.g. GradScaler._scale
        elif a.kind in ("dict", "list"):
            yield from _walk(a.obj)


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Copy of nested dicts/lists/tuples with every tensor replaced by fn(tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        mapped = {k: map_tensors(v, fn) for k, v in value.items()}
        if not isinstance(value, OrderedDict):
            return mapped
        out = OrderedDict(mapped)
        if hasattr(value, "_metadata"):  # module state_dict versions, read by _load_from_state_dict
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if type(value) is tuple:
        return tuple(map_tensors(v, fn) for v in value)
    return value


def capture(items: list[Attached], to_host: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
    """State of every attached object, tensors mapped through `to_host` (a CPU copy or view)."""
    out: dict[str, dict[str, Any]] = {}
    for a in items:
        if a.kind in ("module", "optimizer", "stateful"):
            state = map_tensors(a.obj.state_dict(), to_host)
        elif a.kind == "tensor":
            state = to_host(a.obj.detach())
        elif a.kind == "generator":
            state = a.obj.get_state()
        else:
            state = map_tensors(a.obj, to_host)
        out[a.name] = {"kind": a.kind, "state": state}
    return out


def restore(items: list[Attached], saved: dict[str, dict[str, Any]]) -> list[str]:
    """Load saved state into the attached objects in place. Returns warnings (name mismatches)."""
    warnings: list[str] = []
    for a in items:
        entry = saved.get(a.name)
        if entry is None:
            warnings.append(f"checkpoint has no state for {a.name!r}; it starts fresh")
            continue
        if entry["kind"] != a.kind:
            raise ValueError(f"checkpoint holds {a.name!r} as a {entry['kind']}, now it is a {a.kind}")
        state = entry["state"]
        if a.kind in ("module", "optimizer", "stateful"):
            a.obj.load_state_dict(state)
        elif a.kind == "tensor":
            import torch

            # copy_ broadcasts and casts: a (4,) checkpoint would "restore" a (3, 4) tensor
            if not isinstance(state, torch.Tensor) or state.shape != a.obj.shape or state.dtype != a.obj.dtype:
                what = (f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, torch.Tensor)
                        else f"a {type(state).__name__}")
                raise ValueError(f"checkpoint holds {a.name!r} as {what}, now it is a {a.obj.dtype} tensor of "
                                 f"shape {tuple(a.obj.shape)}")
            with torch.no_grad():
                a.obj.copy_(state)
        elif a.kind == "generator":
            a.obj.set_state(state)
        elif a.kind == "dict":
            a.obj.clear()
            a.obj.update(state)
        else:
            a.obj[:] = state
    extra = set(saved) - {a.name for a in items}
    if extra:
        warnings.append(f"checkpoint state for {sorted(extra)} is not attached any more; ignored")
    return warnings


def signature(items: list[Attached], plain: Iterable[str]) -> str:
    """What tells one attach of a script from its others, the same in every run of the script:
    the names and kinds of what it attaches and the shapes and dtypes of the tensors they hold
    at attach (a module's parameters and buffers, an optimizer's parameters), never values,
    which training changes. A checkpoint keeps those of its process's attaches, so that a restart
    that skips a finished phase still finds the phase the checkpoint is of (pausing.restore_latest)."""
    h = hashlib.sha256()
    for a in sorted(items, key=lambda a: a.name):
        h.update(repr((a.name, a.kind, _layout(a))).encode())
    h.update(repr(sorted(plain)).encode())
    return h.hexdigest()[:16]


def _layout(a: Attached) -> Any:
    obj = a.obj
    try:
        if a.kind == "tensor":
            return tuple(obj.shape), str(obj.dtype)
        if a.kind == "module":
            return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in obj.state_dict().items()
                         if hasattr(v, "shape"))
        if a.kind == "optimizer":
            return tuple(tuple((tuple(p.shape), str(p.dtype)) for p in g["params"]) for g in obj.param_groups)
    except Exception:       # a user's module whose state_dict fails here fails the same in every run
        pass
    return type(obj).__qualname__
