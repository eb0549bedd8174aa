"""A rank's process group around a multi-rank RAM park: tear it down, make it again, rebind.

Why: NCCL's communicators hold device memory that only destroying the group gives back
(`destroy_process_group` calls `shutdown()` on every group, pytorch#111392), and a group cannot be
kept across a park anyway once a peer has destroyed its end. So at the common step every rank
destroys every group, and at resume creates the default group again with the same rank, world
size, backend (and bound device for NCCL) on the *kept* rendezvous store under a fresh prefix
(a second init under the old keys could read the first init's stale entries), then points what
cached the old group at the new one: DDP's reducer and its comm hooks' `state.process_group`,
a ZeroRedundancyOptimizer, FSDP2's mesh infos. docs/design/multi-rank.md section 3 has the sources; tests/multirank proves it on gloo.

What cannot be rebound (FSDP1, groups of the script's own, a comm hook whose state is a group)
is a *refusal*: the rank says so in
`hello` and the park is refused (or, once the disk tier is built, goes to disk) with the reason.

Replaced gloo (and mixed) groups are never released here (`graveyard`): dropping the last
reference to a gloo group right after its last collective can deadlock its destructor against the
GIL (pytorch/pytorch#56297). A destroyed NCCL group is let go: it has freed its communicators, but
kept alive it would keep the tensors of its last collectives (DDP's bucket buffers) on the GPU.
"""
from __future__ import annotations

import gc
import sys
import weakref
from typing import Any, Iterable, Optional

from gpuswap.runtime import ddpreducer
from gpuswap.runtime.ddpreducer import Reducers
from gpuswap.runtime.objects import Attached


def _dist() -> Any:
    """torch.distributed if the job uses it (never imported by us: a job that did not is single-rank)."""
    torch = sys.modules.get("torch")
    if torch is None or "torch.distributed" not in sys.modules:
        return None
    dist = torch.distributed
    return dist if dist.is_available() else None


def _holders(items: Iterable[Attached]) -> list[Any]:
    """Every object that may cache a process group: the attached ones, their submodules and, since
    a script may attach the inner module of its DDP wrapper, every live DDP/ZeRO/FSDP object."""
    found: dict[int, Any] = {}
    for it in items:
        found[id(it.obj)] = it.obj
        modules = getattr(it.obj, "modules", None)
        if it.kind == "module" and callable(modules):
            for m in modules():
                found.setdefault(id(m), m)
    kinds = _kinds()
    if kinds:
        for obj in gc.get_objects():
            if issubclass(type(obj), kinds):    # type(): no attribute access on odd objects
                found.setdefault(id(obj), obj)
    return list(found.values())


def _kinds() -> tuple[type, ...]:
    out: list[type] = []
    for mod, name in (("torch.nn.parallel", "DistributedDataParallel"),
                      ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
                      ("torch.distributed.fsdp", "FSDPModule"),
                      ("torch.distributed.fsdp", "FullyShardedDataParallel")):
        m = sys.modules.get(mod)
        cls = getattr(m, name, None) if m is not None else None
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def _is(obj: Any, mod: str, name: str) -> bool:
    m = sys.modules.get(mod)
    cls = getattr(m, name, None) if m is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


class Regroup:
    """One rank's group state across parks. Training thread only."""

    def __init__(self, items: list[Attached]) -> None:
        self.items = items
        self.graveyard: list[Any] = []     # replaced groups, kept alive (module docstring)
        self.torn = False                  # destroyed by us and not made again yet
        self._store: Any = None
        self._init: dict[str, Any] = {}
        # What the last refusal check found to rebind, and the park's copy of it (weak: a script
        # that drops a wrapper must not find its memory kept alive by us).
        self._found: list[Any] = []
        self._kept: Optional[list[Any]] = None
        self.ddps: list[Any] = []          # weak references to every DDP the last check found
        self.reducers = Reducers()         # their Reducers across parks (runtime/ddpreducer.py)

    def refusal(self) -> Optional[str]:
        """Why this rank's groups cannot be rebuilt in place (None: they can, or there is none)."""
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return None
        holders = _holders(self.items)
        self._found = [weakref.ref(h) for h in holders if _rebindable(h)]
        self.ddps = [weakref.ref(h) for h in holders if _is(h, "torch.nn.parallel", "DistributedDataParallel")]
        if any(_is(h, "torch.distributed.fsdp", "FullyShardedDataParallel") for h in holders):
            return "an FSDP1 module (FullyShardedDataParallel) cannot be rebound to a new process group"
        world = dist.group.WORLD
        others = [pg for pg in list(dist.distributed_c10d._world.pg_map) if pg is not world]
        if others:
            return (f"{len(others)} process group(s) besides the default one (new_group or a "
                    "multi-dimensional DeviceMesh) cannot be re-created in place")
        for h in holders:
            if _is(h, "torch.nn.parallel", "DistributedDataParallel"):
                for _, state in getattr(h, "_comm_hooks", ()):
                    if _hook_group_fixed(state, dist.ProcessGroup):
                        return ("a DDP communication hook holds a process group where it cannot be "
                                "rebound (its state is the group, or keeps it outside `process_group`)")
                if ddpreducer.builtin_hook_kept(h):
                    return ("a built-in DDP communication hook keeps the process group it was registered "
                            "with, and its Reducer is not made again at a park")
        return None

    def teardown(self) -> bool:
        """Keep the rendezvous store, remember how the group was made, destroy every group.
        False: the job has no group (nothing was done)."""
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return False
        c10d = dist.distributed_c10d
        world = dist.group.WORLD
        self._store = c10d._get_default_store()     # also keeps rank 0's TCPStore server alive
        self._init = {"backend": dist.get_backend(), "rank": dist.get_rank(),
                      "world_size": dist.get_world_size()}
        device = getattr(world, "bound_device_id", None)
        if device is not None:
            self._init["device_id"] = device          # NCCL's eager init on the same GPU
        # NCCL groups are let go (their destroy has finished their work): a destroyed NCCL group
        # still holds the tensors of its last collectives (ProcessGroupNCCL stashes them instead of
        # record_stream), DDP's bucket buffers among them, so keeping it kept those on the GPU,
        # one set more per park (seen on an H100, torch 2.11, NCCL 2.28).
        self.graveyard.extend(pg for pg, (backend, _) in list(c10d._world.pg_map.items())
                              if str(backend).lower() != "nccl")
        # The holders the park's refusal check just found: nothing trains while parked, so they are
        # the ones to rebind, and the rebuild skips a second scan of every live object (a few
        # tenths of a second in a torch process, on the resume's critical path).
        self._kept, self._found = self._found, []
        dist.destroy_process_group()
        # What keeps the old group alive keeps the tensors it stashed (above). Until the rebind
        # gives them the new group, DDP, ZeRO and DDP's hook states hold a placeholder of the same
        # rank and size that can do nothing (a Reducer made at unpark is made on it; a collective
        # on it fails): the old group is then held by no one but a Reducer the park keeps.
        holder = dist.ProcessGroup(dist.HashStore(), self._init["rank"], self._init["world_size"])
        for h in (r() for r in self._kept):
            if _is(h, "torch.nn.parallel", "DistributedDataParallel"):
                h.process_group = holder
                for _, state in getattr(h, "_comm_hooks", ()):
                    if isinstance(getattr(state, "process_group", None), dist.ProcessGroup):
                        state.process_group = holder
            elif _is(h, "torch.distributed.optim", "ZeroRedundancyOptimizer"):
                h.process_group = holder
        self.torn = True
        return True

    def rebuild(self, epoch: int) -> bool:
        """Create the default group again (a collective: every rank calls it) and rebind.
        False: none was torn down (nothing was done)."""
        dist = _dist()
        if dist is None or not self.torn:
            return False
        dist.init_process_group(store=dist.PrefixStore(f"gpuswap/{epoch}/", self._store), **self._init)
        self.torn = False
        kept, self._kept = self._kept, None
        self.rebind(None if kept is None else [h for h in (r() for r in kept) if h is not None])
        return True

    def live_ddps(self) -> list[Any]:
        return [d for d in (r() for r in self.ddps) if d is not None]

    def drop_reducers(self) -> int:
        """At a RAM park, once the attached tensors are released: free DDP's bucket buffers
        (runtime/ddpreducer.py). Returns the bytes freed."""
        return self.reducers.drop(self.live_ddps())

    def build_reducers(self) -> None:
        """At unpark: new Reducers for those dropped (their buffers are allocated here)."""
        self.reducers.build()

    def rebind(self, holders: Optional[list[Any]] = None) -> None:
        """Point everything that cached the old default group at the new one (`holders`: found by
        the park's scan; else every live one now)."""
        dist = _dist()
        if dist is None or not dist.is_initialized():
            return
        world = dist.group.WORLD
        for h in (holders if holders is not None else _holders(self.items)):
            if _is(h, "torch.nn.parallel", "DistributedDataParallel"):
                h._update_process_group(world)
                self.reducers.finish(h)       # a Reducer made at unpark: its Logger and hook
                for _, state in getattr(h, "_comm_hooks", ()):     # DDP leaves hooks' groups to us
                    if isinstance(getattr(state, "process_group", None), dist.ProcessGroup):
                        state.process_group = world
            elif _is(h, "torch.distributed.optim", "ZeroRedundancyOptimizer"):
                h.process_group = world
            elif _is(h, "torch.distributed.fsdp", "FSDPModule"):
                _rebind_fsdp2(h)


def _hook_group_fixed(state: Any, pg_type: type) -> bool:
    """A DDP comm hook's state that holds a group we cannot swap: the state is the group itself
    (the reducer's C++ hook keeps that object), or a group sits in an attribute other than
    `process_group`, the one torch's own hook states (PowerSGDState, PostLocalSGDState) use. A state
    of None, or with `process_group=None`, uses the default group at each call: fine."""
    if isinstance(state, pg_type):
        return True
    return any(isinstance(v, pg_type) for k, v in _fields(state) if k != "process_group")


def _fields(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes, from `__dict__` and `__slots__` (PowerSGDState has slots only)."""
    out = list((getattr(obj, "__dict__", None) or {}).items())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in ([slots] if isinstance(slots, str) else slots):
            if hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    return out


def _rebindable(h: Any) -> bool:
    return (_is(h, "torch.nn.parallel", "DistributedDataParallel")
            or _is(h, "torch.distributed.optim", "ZeroRedundancyOptimizer")
            or _is(h, "torch.distributed.fsdp", "FSDPModule"))


def _rebind_fsdp2(module: Any) -> None:
    """FSDP2's mesh resolves groups by name (the same after a rebuild in the same order), but its
    param group's mesh infos cache the group objects (_fsdp_common.py, FSDPMeshInfo)."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return
    for info in (group.mesh_info, group.post_forward_mesh_info):
        if info is not None and hasattr(info, "shard_process_group"):
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
            if getattr(info, "reduce_scatter_process_group", None) is not None:
                info.reduce_scatter_process_group = info.shard_process_group


def find_ddps(items: Iterable[Attached]) -> list[Any]:
    """Weak references to every live DistributedDataParallel (an attached one, one around an
    attached module, one the script keeps elsewhere); none if the job has no process group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return []
    except (RuntimeError, AttributeError):
        return []
    from gpuswap.runtime.rankstate import ddp_wrappers

    return [weakref.ref(d) for d in ddp_wrappers(_holders(items))]
