"""A torchrun worker for tests/multirank/test_mr_ram.py: a small DDP training (gloo, CPU) with the
two gpuswap lines, run under a real daemon and, as the reference, under plain torchrun.

    torchrun --nproc-per-node N mr_job.py --steps S --out DIR [--gate FILE --hold-at H[,H2...]]
             [--no-attach RANK] [--fail-dir DIR]

--gate: at step H (each of them) the ranks keep calling `safepoint(H)` until FILE or FILE.H exists,
so the test can pause and resume the job as often as it likes before it goes on (several holds:
a job restarted from a disk checkpoint goes on to the next one). Whether the gate is open is decided
collectively (an all-reduce of each rank's look at the file), so every rank makes the same number
of safepoint calls: ticks stay in step across ranks, as in any SPMD loop. Nothing trains while
held, so the final state equals the reference's, which runs without a gate.
--no-attach: that rank never calls `gpuswap.attach` (a rank that never attaches).
--fail-dir: a test hook, in this script only: if DIR/part-r<R> exists when rank R writes its part
of a disk checkpoint, the file is removed and the write fails (as a full disk would); if
DIR/manifest exists when rank 0 is about to commit, rank 0 is SIGKILLed (its part is durable, the
manifest is not written).

Each rank writes its parameters, optimizer state and RNG state to DIR/rank{R}.pt, and leaves with
os._exit after destroying its group (a gloo group's destructor can deadlock at exit: pytorch#56297).
"""
from __future__ import annotations

import argparse
import faulthandler
import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gpuswap


class NoJob:
    start_step = 0

    def safepoint(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gate", default="")
    ap.add_argument("--hold-at", default="")
    ap.add_argument("--no-attach", type=int, default=-1)
    ap.add_argument("--fail-dir", default="")
    args = ap.parse_args()
    holds = {int(h) for h in args.hold_at.split(",") if h}
    faulthandler.dump_traceback_later(600, exit=True)   # a hang ends with its stacks
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)                              # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)                        # dropout differs per rank
    data = torch.Generator().manual_seed(7 + rank)
    if args.fail_dir:
        fail_hooks(Path(args.fail_dir), rank)
    job = NoJob() if rank == args.no_attach else gpuswap.attach(model=model, optimizer=opt, data=data)
    for step in range(job.start_step, args.steps):
        x = torch.randn(8, 16, generator=data)
        y = torch.randn(8, 4, generator=data)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        job.safepoint(step)
        if args.gate and step in holds:
            deadline = time.monotonic() + 600
            while True:
                is_open = os.path.exists(args.gate) or os.path.exists(f"{args.gate}.{step}")
                seen = torch.tensor([int(is_open or time.monotonic() > deadline)])
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
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fail_hooks(where: Path, rank: int) -> None:
    """The failures test_mr_disk.py asks for, through the files it creates (see the docstring)."""
    from gpuswap.runtime import ckparts

    write_part, write_manifest = ckparts.write_part, ckparts.write_manifest

    def part(directory, payload, seq=None):
        flag = where / f"part-r{rank}"
        if flag.exists():
            flag.unlink()
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return write_part(directory, payload, seq)

    def manifest(*a, **kw):
        if (where / "manifest").exists():
            os.kill(os.getpid(), signal.SIGKILL)
        return write_manifest(*a, **kw)

    ckparts.write_part, ckparts.write_manifest = part, manifest


if __name__ == "__main__":
    main()
