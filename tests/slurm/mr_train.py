"""A 2-rank DDP training (gloo, CPU) for tests/slurm/test_slurm_multirank.py, with the two gpuswap
lines. Its rank comes from torchrun (RANK, WORLD_SIZE) or from Slurm (SLURM_PROCID, SLURM_NTASKS,
with MASTER_ADDR/MASTER_PORT exported by the batch script), as gpuswap's own rank identity does.

    python mr_train.py --steps S --hold-at H --out DIR

From step H on, the ranks keep calling `safepoint(H)` (nothing trains meanwhile) until a
preemption ends the run; whether to hold on is decided collectively, so every rank makes the same
number of safepoint calls. A run restarted from a checkpoint taken there starts after H and ends.
Each rank writes its parameters, optimizer state and RNG states to DIR/rank{R}.pt and leaves with
os._exit after destroying its group (a gloo group's destructor can deadlock at exit: pytorch#56297).
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpuswap


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(600, exit=True)   # a hang ends with its stacks
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)                              # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)                        # dropout differs per rank
    data = torch.Generator().manual_seed(7 + rank)
    job = gpuswap.attach(model=model, optimizer=opt, data=data)
    print(f"train: rank {rank} of {world} starts at step {job.start_step}", flush=True)
    for step in range(job.start_step, args.steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        job.safepoint(step)
        if step == args.hold_at:
            print(f"train: rank {rank} holds at step {step}", flush=True)
            deadline = time.monotonic() + 600
            while True:
                seen = torch.tensor([int(time.monotonic() > deadline)])
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)
                if seen.item():
                    break
                job.safepoint(step)
                time.sleep(0.02)
    job.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
             "optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "data": data.get_state()}
    torch.save(state, out / f"rank{rank}.pt")
    print(f"train: rank {rank} finished", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
