"""A torchrun worker for tests/multirank/test_disk_parts.py (gloo, CPU).

Trains a small model data-parallel, for each of `--modes` in turn (DDP, DDP +
ZeroRedundancyOptimizer, FSDP2; one launch serves them all: starting torchrun is most of the
cost). At the safepoint of step `--ckpt-at` every rank writes its part of a multi-rank
checkpoint (runtime/rankstate.py, runtime/ckparts.py) and rank 0 commits the manifest once every
part is durable: what a disk park does (docs/design/multi-rank.md §4). Then it exits, as a disk
park does, or with `--go-on` trains on to the end (writing a checkpoint must not change the run:
that run is then the uninterrupted reference). At start, every rank restores from its mode's
checkpoint directory if there is one and trains on from the step after it. At the end each rank
writes its parameters, optimizer state, RNG states, data generator and job.state; the test
compares, bitwise and rank by rank, a run restored from the checkpoint with the reference.

The ranks meet before writing on a store fact (standing in for the agreement, which this test
does not run), and the part reports travel to rank 0 through the store (standing in for the
coordinator's `commit`).

    torchrun --nproc-per-node N disk_parts_job.py --modes ddp,zero,fsdp2 --steps S \
             [--ckpt-at K [--go-on]] --ckpt DIR --out DIR
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpuswap.runtime import ckparts, objects, rankstate
from dist_helpers import all_arrived, full_state, local


class Net(nn.Module):
    """Layers registered in an order other than the one they run in, and a small DDP bucket
    cap: DDP's first-iteration buckets (reverse registration order) then differ from the ones it
    rebuilds from the gradients' arrival order, which a disk restart starts over with
    (design open question 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(48, 4)
        self.inp = nn.Linear(16, 48)
        self.mid = nn.Linear(48, 48)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.inp(x)))
        return self.out(torch.relu(self.mid(x)))


def build(mode: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(1234)                       # the same initial weights on every rank
    net = Net()
    if mode in ("ddp", "zero"):
        model: nn.Module = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.004)
        if mode == "ddp":
            opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (net.inp, net.mid, net.out):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        raise SystemExit(f"unknown mode {mode}")
    return model, opt


def write_checkpoint(items: list[objects.Attached], state: dict, ckpt: Path, step: int, key: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    all_arrived(store, f"{key}/at/{step}", world)          # every rank at the common step
    payload = rankstate.part_payload(items, state, rank=rank, world_size=world, step=step, tick=step,
                                     job_id="disk-test", to_host=lambda t: t.detach().cpu().clone())
    store.set(f"{key}/part/{rank}", json.dumps(ckparts.write_part(ckpt, payload)))
    if rank == 0:
        store.wait([f"{key}/part/{r}" for r in range(world)])
        parts = [json.loads(store.get(f"{key}/part/{r}")) for r in range(world)]
        ckparts.write_manifest(ckpt, parts, step=step, tick=step, world_size=world, job_id="disk-test")
        store.set(f"{key}/committed", "1")
    store.wait([f"{key}/committed"])                      # rank 0's store outlives every client


def train(mode: str, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(mode)
    torch.manual_seed(100 + rank)                 # dropout differs per rank, as in real jobs
    random.seed(200 + rank)
    data = torch.Generator().manual_seed(7 + rank)
    items = [objects.classify("model", model), objects.classify("optimizer", opt),
             objects.classify("data", data)]
    state: dict[str, Any] = {"epoch": 0, "seen": []}
    ckpt = Path(args.ckpt) / mode
    done = rankstate.restore_latest(str(ckpt), None, items, state, rank, world)
    for step in range(done.start_step, args.steps):
        x = torch.randn(8, 16, generator=data) + random.random()
        y = torch.randn(8, 4, generator=data)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        state["seen"].append(step)
        if step == args.ckpt_at:                  # the safepoint of `step`
            write_checkpoint(items, state, ckpt, step, f"disk/{mode}")
            if not args.go_on:
                leave(0)                          # a disk park ends the launch (exit 75 there)
    optim_state = opt.optim.state_dict() if mode == "zero" else opt.state_dict()
    result = {"params": full_state(model), "optimizer": local(optim_state),
              "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
              "data": data.get_state(), "state": state, "restored": done.seq}
    out = Path(args.out) / mode
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")


def leave(code: int) -> None:
    dist.destroy_process_group()
    # without destructors: the DDP reducer can drop the last group reference under the GIL
    # at interpreter exit (pytorch#56297; docs/design/multi-rank.md section 0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="ddp")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ckpt-at", type=int, default=-1)
    ap.add_argument("--go-on", action="store_true")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--watchdog-s", type=float, default=170.0)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)   # a hang fails with its stacks
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    for mode in args.modes.split(","):
        train(mode, args)
    leave(0)


if __name__ == "__main__":
    main()
