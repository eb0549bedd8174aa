"""For tests/multirank/test_regroup_hooks.py: one gloo process (world size 1), DDP modules with
communication hooks of each kind; prints what `Regroup` says and does, as JSON."""
from __future__ import annotations

import gc
import json
import os
import sys
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from gpuswap.runtime.objects import classify
from gpuswap.runtime.regroup import Regroup


def ddp(state, hook=default_hooks.allreduce_hook):
    m = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    if hook is not None:
        m.register_comm_hook(state, hook)
    return m


def odd_hook(state, bucket):
    return default_hooks.allreduce_hook(state.group, bucket)


def step(m):
    m(torch.randn(3, 4)).sum().backward()


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    # torch's own hook state (PowerSGDState keeps `process_group`, in a slot): rebound after the rebuild
    state = powerSGD_hook.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=1,
                                        start_powerSGD_iter=2)
    m = ddp(state, powerSGD_hook.powerSGD_hook)
    step(m)
    rg = Regroup([classify("model", m)])
    out["powersgd_refusal"] = rg.refusal()
    old = dist.group.WORLD
    rg.teardown()
    rg.rebuild(1)
    out["powersgd_rebound"] = state.process_group is dist.group.WORLD and state.process_group is not old
    for _ in range(3):
        step(m)     # the hook runs on the new group (PowerSGD itself from the third step)
    del m, rg
    gc.collect()
    # a group in another attribute of the state: not ours to know how it is used: refused
    odd = types.SimpleNamespace(group=dist.group.WORLD)
    out["odd_state_refusal"] = Regroup([classify("model", ddp(odd, odd_hook))]).refusal()
    # a hook whose state is None uses the default group at each call: nothing to refuse
    out["none_state_refusal"] = Regroup([classify("model", ddp(None))]).refusal()
    # the group itself as the state: the reducer's C++ hook keeps that object: refused
    out["group_state_refusal"] = Regroup([classify("model", ddp(dist.group.WORLD))]).refusal()
    gc.collect()
    # a built-in hook keeps, in C++, the group it was registered with: fine where the park makes the
    # Reducer again and registers the hook on the new group (runtime/ddpreducer.py), refused where
    # the Reducer is kept (static_graph)
    for name, static in (("builtin_refusal", False), ("builtin_static_refusal", True)):
        m = nn.parallel.DistributedDataParallel(nn.Linear(4, 2), static_graph=static)
        m._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        out[name] = Regroup([classify("model", m)]).refusal()
        del m
        gc.collect()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
