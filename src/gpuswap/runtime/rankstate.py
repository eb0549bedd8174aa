"""What each rank's part of a multi-rank checkpoint holds, and putting it back in place.

Design §4 (docs/design/multi-rank.md). A state goes into rank 0's part only ("shared") when it is
*provably* bitwise the same on every rank; everything else goes into each rank's own part, which
is always correct, only larger:

* a module's parameters that a `DistributedDataParallel` among the attached objects (or the
  `related` wrappers the runtime knows) replicates: DDP broadcasts them at construction and every
  rank applies the same all-reduced gradients. Its buffers stay per rank (BatchNorm statistics
  are updated locally after DDP's buffer broadcast; with `broadcast_buffers=False` never synced);
* a plain optimizer over whole DDP parameter sets (same gradients, same update on every rank).
  An optimizer over part of a DDP's parameters, like ZeroRedundancyOptimizer's local one, is not:
  each rank owns a different part;
* `ZeroRedundancyOptimizer`: its `state_dict()` is the consolidated global state (a collective,
  `consolidate_state_dict`), so each rank saves its local optimizer's state (its shard) and the
  exposed hyperparameters instead, and loads them back the same way;
* FSDP2 (DTensor) parameters and optimizer states: each rank saves its local shard
  (`to_local()`) and the placements, and restores into the DTensor the job built again;
* RNG states, `job.state`, generators, tensors, dicts, lists, schedulers, unknown objects:
  each rank's own copy.

Serialization is the single-rank one: `objects.capture`'s state_dicts, `rng.capture`, torch.save.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NoReturn

from gpuswap.runtime import ckparts, ddpbuckets, objects, rng
from gpuswap.runtime.checkpoint import CheckpointError, other_attach
from gpuswap.runtime.checkpoint import attach_of as checkpoint_attach_of
from gpuswap.runtime.objects import Attached

OWN, SHARED, SPLIT, ZERO = "own", "shared", "split", "zero"


@dataclass
class Sharded:
    """One DTensor in a part: this rank's local shard, and what it was a shard of (checked at
    restore against the DTensor the restarted job built)."""

    local: Any
    placements: str
    shape: tuple[int, ...]


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements") and hasattr(t, "device_mesh")


def _ddp_class() -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return None
    return torch.nn.parallel.DistributedDataParallel


def _zero_class() -> Any:
    if "torch.distributed.optim" not in sys.modules:
        return None
    return getattr(sys.modules["torch.distributed.optim"], "ZeroRedundancyOptimizer", None)


def ddp_wrappers(objs: Iterable[Any]) -> list[Any]:
    """The DistributedDataParallel wrappers among `objs`, in order, each once."""
    ddp = _ddp_class()
    seen: dict[int, Any] = {}
    for o in objs if ddp is not None else ():
        if isinstance(o, ddp):
            seen.setdefault(id(o), o)
    return list(seen.values())


def replicated_sets(objs: Iterable[Any]) -> list[set[int]]:
    """Per DDP wrapper among `objs`: the ids of the parameters it keeps equal on every rank."""
    ddp = _ddp_class()
    out = []
    for o in objs if ddp is not None else ():
        if isinstance(o, ddp):
            ignore = set(getattr(o, "parameters_to_ignore", ()) or ())
            out.append({id(p) for n, p in o.module.named_parameters()
                        if p.requires_grad and n not in ignore and not _is_dtensor(p)})
    return out


def layout(items: list[Attached], related: Iterable[Any] = ()) -> dict[str, str]:
    """Where each attached object's state goes: SHARED (rank 0's part), SPLIT (a module: its
    replicated parameters in rank 0's part, the rest in every part), ZERO, or OWN (every part)."""
    sets = replicated_sets([a.obj for a in items] + list(related))
    replicated = set().union(*sets) if sets else set()
    zero = _zero_class()
    out: dict[str, str] = {}
    for a in items:
        how = OWN
        if a.kind == "optimizer" and zero is not None and isinstance(a.obj, zero):
            how = ZERO
        elif a.kind == "module" and replicated:
            kept = a.obj.state_dict(keep_vars=True)
            if any(id(v) in replicated for v in kept.values()):
                how = SPLIT
        elif a.kind == "optimizer" and replicated:
            params = {id(p) for g in a.obj.param_groups for p in g["params"]}
            # whole DDP parameter sets only: a ZeRO local optimizer holds a different part per rank
            if params and all(s <= params or not (s & params) for s in sets) and params <= replicated:
                how = SHARED
        out[a.name] = how
    return out


def _host_fn(to_host: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def fn(t: Any) -> Any:
        if _is_dtensor(t):
            return Sharded(to_host(t.to_local().detach()), repr(tuple(t.placements)), tuple(t.shape))
        return to_host(t)
    return fn


def _zero_state(opt: Any, fn: Callable[[Any], Any]) -> dict[str, Any]:
    return {"local": objects.map_tensors(opt.optim.state_dict(), fn),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def split(items: list[Attached], rank: int, to_host: Callable[[Any], Any],
          related: Iterable[Any] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, own): the states for rank 0's part only (empty on other ranks: nothing is even
    copied off the device there) and for this rank's own part. Entries are objects.capture's
    {kind, state}; own entries add `how` (see `layout`), and their state is None for SHARED."""
    fn = _host_fn(to_host)
    where = layout(items, related)
    sets = replicated_sets([x.obj for x in items] + list(related))
    replicated = set().union(*sets) if sets else set()
    shared: dict[str, Any] = {}
    own: dict[str, Any] = {}
    for a in items:
        how = where[a.name]
        entry: dict[str, Any] = {"kind": a.kind, "how": how, "state": None}
        if how == SPLIT:
            keys = {k for k, v in a.obj.state_dict(keep_vars=True).items() if id(v) in replicated}
            sd = a.obj.state_dict()
            mine = OrderedDict((k, v) for k, v in sd.items() if k not in keys)
            mine._metadata = getattr(sd, "_metadata", None)  # type: ignore[attr-defined]
            entry["state"] = objects.map_tensors(mine, fn)
            if rank == 0:
                shared[a.name] = {"kind": a.kind,
                                  "state": {k: fn(v) for k, v in sd.items() if k in keys}}
        elif how == SHARED:
            if rank == 0:
                shared[a.name] = objects.capture([a], fn)[a.name]
        elif how == ZERO:
            entry["state"] = _zero_state(a.obj, fn)
        else:
            entry["state"] = objects.capture([a], fn)[a.name]["state"]
        own[a.name] = entry
    return shared, own


def part_payload(items: list[Attached], user_state: dict[str, Any], *, rank: int, world_size: int,
                 step: int, tick: int | None, job_id: str | None, to_host: Callable[[Any], Any],
                 related: Iterable[Any] = (), attach: int = 1) -> dict[str, Any]:
    """The dict `ckparts.write_part` saves for this rank. `to_host(t)` is the single-rank
    snapshot's (a view of the parked host copy, or a CPU copy). `attach`: which attach of the
    process this is (checkpoint.attach_of)."""
    shared, own = split(items, rank, to_host, related)
    ddps = ddp_wrappers([a.obj for a in items] + list(related))
    return {"format": ckparts.FORMAT, "rank": int(rank), "world_size": int(world_size),
            "step": int(step), "tick": tick, "job_id": job_id, "shared": shared, "own": own,
            "ddp_buckets": [ddpbuckets.layout(d) for d in ddps],
            "user_state": objects.map_tensors(user_state, _host_fn(to_host)), "rng": rng.capture(),
            "attach": int(attach)}


def _unshard(value: Any, template: Callable[[tuple], Any], path: tuple = ()) -> Any:
    """`value` with every Sharded replaced by a DTensor like `template(path)` (same mesh and
    placements) holding the saved local shard."""
    if isinstance(value, Sharded):
        like = template(path)
        if like is None or not _is_dtensor(like):
            raise CheckpointError(f"{'/'.join(map(str, path))} was a sharded tensor; nothing sharded to restore it into now")
        if repr(tuple(like.placements)) != value.placements or tuple(like.shape) != value.shape:
            raise CheckpointError(f"{'/'.join(map(str, path))}: saved as {value.placements} of {value.shape}, "
                                  f"the job now has {tuple(like.placements)} of {tuple(like.shape)}")
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value.local.to(like.device), like.device_mesh, like.placements,
                                  run_check=False, shape=like.shape, stride=like.stride())
    if isinstance(value, dict):
        out = {k: _unshard(v, template, path + (k,)) for k, v in value.items()}
        if isinstance(value, OrderedDict):
            od = OrderedDict(out)
            if hasattr(value, "_metadata"):
                od._metadata = value._metadata  # type: ignore[attr-defined]
            return od
        return out
    if isinstance(value, list):
        return [_unshard(v, template, path + (i,)) for i, v in enumerate(value)]
    return value


def _template(a: Attached) -> Callable[[tuple], Any]:
    """The live tensor a saved path corresponds to (a module's state_dict key, an optimizer
    state's parameter), or None."""
    if a.kind == "module":
        live = a.obj.state_dict()
        return lambda path: live.get(path[0]) if path else None
    if a.kind == "optimizer":
        opt = getattr(a.obj, "optim", a.obj)      # ZeRO: its local optimizer's indices
        params = [p for g in opt.param_groups for p in g["params"]]

        def by_param(path: tuple) -> Any:
            if "state" in path:
                i = path[path.index("state") + 1] if len(path) > path.index("state") + 1 else None
                if isinstance(i, int) and 0 <= i < len(params):
                    return params[i]
            return None
        return by_param
    return lambda path: None


def restore(items: list[Attached], own_part: dict[str, Any], shared_part: dict[str, Any],
            related: Iterable[Any] = ()) -> list[str]:
    """Load a chosen checkpoint into the attached objects in place: shared state from rank 0's
    part, everything else from this rank's own; give each DDP wrapper the bucket layout it had
    (ddpbuckets.py: bitwise with 3+ ranks). Call before the first forward. Returns warnings.
    Global RNGs are restored too; `job.state` is the caller's (`own_part["user_state"]`)."""
    warnings: list[str] = []
    ddps = ddp_wrappers([a.obj for a in items] + list(related))
    saved_buckets = own_part.get("ddp_buckets") or []
    for n, ddp in enumerate(ddps):
        buckets = saved_buckets[n] if n < len(saved_buckets) else None
        why = (ddpbuckets.apply(ddp, buckets) if buckets is not None else
               "the checkpoint was written before DDP rebuilt its buckets: the first step after the "
               "restore uses DDP's initial buckets")
        if why is not None and ddp.process_group.size() > 2:
            warnings.append(f"{why} (with {ddp.process_group.size()} ranks its last bits may differ "
                            "from an uninterrupted run)")
    saved_own, saved_shared = own_part.get("own") or {}, shared_part.get("shared") or {}
    merged: dict[str, dict[str, Any]] = {}
    for a in items:
        entry = saved_own.get(a.name)
        if entry is None:
            continue                    # objects.restore warns
        how = entry.get("how", OWN)
        if how in (SHARED, SPLIT) and a.name not in saved_shared:
            raise CheckpointError(f"rank 0's part has no shared state for {a.name!r}")
        if how == SHARED:
            state = saved_shared[a.name]["state"]
        elif how == SPLIT:
            state = OrderedDict(saved_shared[a.name]["state"])
            state.update(entry["state"])
            if hasattr(entry["state"], "_metadata"):
                state._metadata = entry["state"]._metadata  # type: ignore[attr-defined]
        else:
            state = entry["state"]
        state = _unshard(state, _template(a))
        if how == ZERO:
            zero = _zero_class()
            if zero is None or not isinstance(a.obj, zero):
                raise CheckpointError(f"{a.name!r} was a ZeroRedundancyOptimizer, now it is a {type(a.obj).__name__}")
            a.obj.optim.load_state_dict(state["local"])
            zero._sync_param_groups(state["groups"], a.obj.param_groups)
            zero._sync_param_groups(a.obj.param_groups, a.obj.optim.param_groups)
            continue
        merged[a.name] = {"kind": entry["kind"], "state": state}
    attached = {a.name for a in items}
    saved = dict(merged)
    saved.update({k: v for k, v in saved_own.items() if k not in attached})  # warned: not attached now
    zero_names = {k for k, v in saved_own.items() if v.get("how") == ZERO}
    warnings += objects.restore([a for a in items if a.name not in zero_names], saved)
    warnings += rng.restore(own_part["rng"])
    return warnings


@dataclass(frozen=True)
class Restored:
    """What `restore_latest` did, for the rank's `hello` (`restored_step`, `restored_bytes`,
    `restore_s`, `restore_note`, and `restored_seq`: ranks that restored different checkpoints
    must not train on together)."""

    seq: int | None = None
    step: int | None = None
    start_step: int = 0
    bytes: int = 0
    seconds: float | None = None
    note: str | None = None
    checkpoint_of: int | None = None    # the attach that wrote the checkpoint found, when not this one


def _cannot_resume(control: str | None, rank: int, exc: BaseException) -> NoReturn:
    text = f"cannot resume: rank {rank}: {' '.join(str(exc).split())}"     # one line (load_state_dict's are many)
    print(f"gpuswap: {text}", file=sys.stderr, flush=True)
    if control:
        from gpuswap.runtime.client import send_once

        from gpuswap.protocol.records import RestoreFailed

        send_once(control, RestoreFailed(message=text[:2000]))
    raise SystemExit(1) from None


def choose_or_exit(ckpt_dir: str | None, control: str | None, rank: int,
                   world_size: int, job_id: str | None = None) -> tuple[ckparts.Chosen | None, str | None]:
    """`ckparts.choose` for this rank, its note printed. Checkpoints exist but none is usable and
    no restart was asked for: the supervisor is told why (`restore_failed`) and the process exits
    1, as the single-rank `pausing.choose_or_exit` does. Used at attach and by the Lightning and
    Hugging Face callbacks before it (runtime/prerestore.py)."""
    try:
        chosen, note = ckparts.choose(ckpt_dir, rank, world_size, job_id=job_id)
    except (CheckpointError, ValueError, RuntimeError, KeyError) as exc:
        _cannot_resume(control, rank, exc)
    if note:
        print(f"gpuswap: {note}", file=sys.stderr, flush=True)
    return chosen, note


def restore_latest(ckpt_dir: str | None, control: str | None, items: list[Attached],
                   user_state: dict[str, Any], rank: int, world_size: int,
                   related: Iterable[Any] = (), job_id: str | None = None, attach_no: int = 1) -> Restored:
    """At attach, on every rank of a multi-rank job: restore the newest usable checkpoint in
    place (its own part, and rank 0's shared state), and `user_state` (job.state) from its own
    part. No usable checkpoint, or one that does not fit the objects (another model, other
    sharding): `restore_failed` and exit 1 (`choose_or_exit`). A checkpoint another attach of
    the process wrote (`attach_no` is this one's) is left to it, as on a single rank
    (`checkpoint.other_attach`): every rank reads the same parts, so all of them decide alike."""
    import time

    t0 = time.perf_counter()
    chosen, note = choose_or_exit(ckpt_dir, control, rank, world_size, job_id)
    if chosen is None:
        return Restored(note=note)
    written_by = checkpoint_attach_of(chosen.own)
    other = other_attach(written_by, attach_no, chosen.info.seq, int(chosen.own["step"]))
    if other is not None:
        print(f"gpuswap: rank {rank}: {other}", file=sys.stderr, flush=True)
        return Restored(note="; ".join(filter(None, [note, other])), checkpoint_of=written_by)
    try:
        warnings = restore(items, chosen.own, chosen.shared, related)
        saved_state = _unshard(chosen.own.get("user_state") or {}, lambda path: None)
    except (CheckpointError, ValueError, RuntimeError, KeyError) as exc:
        _cannot_resume(control, rank, exc)
    user_state.clear()
    user_state.update(saved_state)
    for w in warnings:
        print(f"gpuswap: {w}", file=sys.stderr, flush=True)
    step = int(chosen.own["step"])
    print(f"gpuswap: rank {rank} restored checkpoint seq {chosen.info.seq} (step {step}); "
          f"resuming at step {step + 1}", file=sys.stderr, flush=True)
    return Restored(seq=chosen.info.seq, step=step, start_step=step + 1, bytes=chosen.info.bytes,
                    seconds=round(time.perf_counter() - t0, 6), note=note)
