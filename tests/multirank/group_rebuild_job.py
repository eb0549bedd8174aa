"""A torchrun worker for tests/multirank/test_group_rebuild.py (gloo, CPU).

Trains a small model data-parallel and, at the steps given by --park-at, does what a multi-rank
RAM park has to do between two steps (docs/design/multi-rank.md, "RAM park"):

  1. keep the rendezvous store (the default group's TCPStore) and destroy every process group;
  2. park the attached tensors with gpuswap's own parking code (simulated device = CPU: every
     storage copied to host and resized to 0 bytes, then refilled in place);
  3. create the default group again, same ranks, same backend, on the kept store under a fresh
     key prefix (a second init under the old keys could read the first init's stale entries);
  4. rebind what held the old group: DDP's reducer (`_update_process_group`), the
     ZeroRedundancyOptimizer's `process_group`, FSDP2's cached mesh groups.

At the end each rank writes its parameters, optimizer state and RNG state; the test compares a
run with rebuilds against an uninterrupted one, bitwise, rank by rank.

    torchrun --nproc-per-node N group_rebuild_job.py --mode ddp|zero|fsdp2 --steps S \
             [--park-at 3,7] --out DIR
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuswap.runtime import objects, parking


def build(mode: str) -> tuple[nn.Module, Any, list[objects.Attached]]:
    torch.manual_seed(1234)                       # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                        nn.ReLU(), nn.Linear(32, 4))
    if mode == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(net)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        raise SystemExit(f"unknown mode {mode}")
    items = [objects.classify("model", model), objects.classify("optimizer", opt)]
    if mode == "zero":
        items.append(objects.classify("local_optimizer", opt.optim))
    return model, opt, items


def local_tensors(items: list[objects.Attached]) -> list[torch.Tensor]:
    """What gpuswap's parking would be handed: DTensors (FSDP2) unwrapped to their local shard."""
    out = []
    for t in objects.iter_tensors(items):
        local = getattr(t, "_local_tensor", None)
        out.append(local if local is not None else t)
    return out


def rebind(model: nn.Module, opt: Any, mode: str) -> None:
    """Point everything that cached the old default group at the new one."""
    world = dist.group.WORLD
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model._update_process_group(world)
    if mode == "zero":
        opt.process_group = world
    if mode == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for info in (group.mesh_info, group.post_forward_mesh_info):
                if info is not None and hasattr(info, "shard_process_group"):
                    info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
                    if getattr(info, "reduce_scatter_process_group", None) is not None:
                        info.reduce_scatter_process_group = info.shard_process_group


def all_arrived(store: Any, key: str, world_size: int) -> None:
    """Return once every rank has reached this point. The store stands in for the supervisor's
    agreement (every rank ready at the common step) and is not a collective of the group, which
    is about to be destroyed. The last rank to arrive sets the fact the others wait on; the
    store's own timeout is the deadline."""
    if int(store.add(key, 1)) == world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])


# Groups replaced by a rebuild. The last reference to a ProcessGroupGloo must not be dropped
# while the GIL is held and its worker threads may still be destroying the step's last work
# (the destructor joins them; a work that holds a Python object needs the GIL to die: a
# deadlock, seen here as a hang with ~ProcessGroupGloo under Reducer's dealloc, pytorch#56297).
# Kept here, an old group dies later, long idle (the runtime keeps them until the next park).
GRAVEYARD: list[Any] = []


def park_and_rebuild(model: nn.Module, opt: Any, items: list[objects.Attached], mode: str,
                     generation: int) -> int:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()   # keeps the TCPStore (client or server) alive
    # No rank may tear down its end of the group while a peer could still be finishing the
    # step's last collective with it: destroy only once every rank is at the common step.
    all_arrived(store, f"gpuswap/at/{generation}", world_size)
    GRAVEYARD.append(dist.group.WORLD)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    park = parking.copy_to_host(local_tensors(items), simulated=True)
    parking.release(park, simulated=True)
    freed = park.nbytes
    assert all(s.storage.nbytes() == 0 for s in park.slots.values() if s.resizable)
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gpuswap/rebuild/{generation}/", store),
                            rank=rank, world_size=world_size)
    assert dist.group.WORLD is not GRAVEYARD[-1]   # a new group, not the old one revived
    rebind(model, opt, mode)
    return freed


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as whole tensors (FSDP2's DTensors gathered: a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def local(obj: Any) -> Any:
    """The object with every DTensor replaced by this rank's shard: comparable without a group."""
    if hasattr(obj, "to_local"):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="ddp")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--park-at", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--watchdog-s", type=float, default=170.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)   # a hang fails with its stacks
    park_at = {int(s) for s in args.park_at.split(",") if s}
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, items = build(args.mode)
    torch.manual_seed(100 + rank)                 # dropout differs per rank, as in real jobs
    data = torch.Generator().manual_seed(7 + rank)
    initial = full_state(model)
    rebuilt, freed = 0, []
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)          # grads stay allocated: parked with the rest
        if step in park_at:                       # the safepoint of `step`
            rebuilt += 1
            freed.append(park_and_rebuild(model, opt, items, args.mode, rebuilt))
    if args.mode == "zero":
        opt.consolidate_state_dict(to=0)
    result = {"params": full_state(model), "initial": initial, "rng": torch.get_rng_state(), "rebuilt": rebuilt, "freed": freed,
              "groups": len({id(g) for g in GRAVEYARD + [dist.group.WORLD]}),   # kept alive: ids unique
              "optimizer": local(opt.state_dict()) if args.mode != "zero" or rank == 0 else None}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()
    # Leave without running destructors: at interpreter exit the DDP reducer can drop the last
    # reference to the live group under the GIL, the deadlock above (with or without rebuilds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
