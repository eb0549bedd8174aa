"""For tests/multirank/test_ddpreducer.py: one gloo process (world size 1) whose rank handle is
parked to RAM and brought back through its own park, unpark and regroup steps
(`RankJob._carry_out`, as the supervisor's messages drive them), on a simulated GPU, for DDP
models of each kind runtime/ddpreducer.py treats; prints what it saw as JSON.

Each case trains a model 3 steps, parks, resumes and trains 3 more, and compares the result with
the same 6 steps without a park. World size 1 makes the comparison about the Reducer alone (its
copies into the buckets and back, the unused-parameter zeros, the hooks), not the summation order.
"""
from __future__ import annotations

import gc
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.multiprocessing.reductions import StorageWeakRef

from gpuswap import simcuda
from gpuswap.protocol.env import SIM_CUDA_DIR
from gpuswap.runtime import rankcursor
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.objects import classify
from gpuswap.runtime.ranks import RankIdentity, RankJob


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(8, 32), nn.Linear(32, 2), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Probe:
    def __init__(self) -> None:
        self.refs: list[Any] = []


def probe_hook(state, bucket):  # unannotated: DDP checks annotations
    state.refs.append(StorageWeakRef(bucket.buffer().untyped_storage()))
    return default_hooks.allreduce_hook(None, bucket)


def build(case: str) -> tuple[nn.Module, Any, Probe | None]:
    torch.manual_seed(0)
    net: nn.Module = Net() if case == "find_unused" else nn.Sequential(Net().a, nn.ReLU(), nn.Linear(32, 2))
    kw = {"find_unused_parameters": case == "find_unused", "static_graph": case == "static_graph",
          "gradient_as_bucket_view": case == "grad_views", "bucket_cap_mb": 0.001}
    ddp = nn.parallel.DistributedDataParallel(net, **kw)
    probe = None
    if case in ("hook", "find_unused"):
        probe = Probe()
        ddp.register_comm_hook(probe, probe_hook)
    elif case == "builtin_hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), probe


def train(ddp: nn.Module, opt: Any, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)


def carry(job: RankJob, action: str) -> dict[str, Any]:
    ok, info = job._carry_out(action)
    assert ok, info
    return info


def held(dev: simcuda.SimDevice) -> int:
    return sum(n for pid, _, n in dev.resident() if pid == os.getpid())


def run(case: str, dev: simcuda.SimDevice) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    ref, ref_opt, _ = build(case)
    train(ref, ref_opt, gen, 6)
    expected = [p.detach().clone() for p in ref.parameters()]
    del ref, ref_opt
    gc.collect()

    gen = torch.Generator().manual_seed(1)
    ddp, opt, probe = build(case)
    calls = [0]
    node = get_gradient_edge(ddp.module[0].weight if case != "find_unused" else ddp.module.a.weight).node
    node.register_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))   # a hook on the node, node not kept
    del node
    train(ddp, opt, gen, 3)
    job = RankJob([classify("model", ddp), classify("optimizer", opt)],
                  RuntimeConfig(job_id="t", control=None, ckpt_dir=None, simulated=True), RankIdentity(0, 2, 0))
    job.measure()
    out: dict[str, Any] = {"running": held(dev), "attached": job._last_bytes,
                           "params": sum(p.numel() * p.element_size() for p in ddp.parameters())}
    layout = _layout(ddp)
    old_group = dist.group.WORLD
    carry(job, rankcursor.PARK)
    out["parked"] = held(dev)
    out["reducer_dropped"] = ddp.reducer is None
    out["freed"] = None if probe is None else all(r.expired() for r in probe.refs) and bool(probe.refs)
    out["kept"] = sorted(job._regroup.reducers.kept.values())
    carry(job, rankcursor.UNPARK)
    out["unparked"] = held(dev)
    carry(job, rankcursor.REGROUP)
    out["layout_kept"] = _layout(ddp) == layout
    out["new_group"] = ddp.process_group is dist.group.WORLD and dist.group.WORLD is not old_group
    out["hook_name"] = ddp._get_ddp_logging_data().get("comm_hook", "")
    before = calls[0]
    if probe is not None:
        probe.refs.clear()
    train(ddp, opt, gen, 3)
    out["node_hook_calls_after"] = calls[0] - before
    out["hook_ran_after"] = None if probe is None else len(probe.refs) > 0
    out["bitwise"] = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                         for a, b in zip(expected, (p.detach() for p in ddp.parameters())))
    job.close()
    return out


def _layout(ddp: nn.Module) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [[index[id(p)] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


def main() -> None:
    torch.use_deterministic_algorithms(True)
    dev = simcuda.SimDevice(os.environ[SIM_CUDA_DIR])
    dev.prepare()
    dev.describe([2**40])                  # what the daemon's simulated driver writes at start
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {case: run(case, dev) for case in sys.argv[1:]}
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)     # replaced gloo groups stay referenced; their destructors can deadlock (pytorch#56297)


if __name__ == "__main__":
    main()
