"""Demo training job: a small MLP fitting a synthetic regression target, fully deterministic.

Runs on CUDA when available, else CPU, with or without gpuswap (outside it `attach` is a no-op).
It exercises everything a resume must get right: parameters, AdamW state, an LR scheduler, a
batch-sampling generator, dropout (torch's global RNG), Python's `random`, and `job.state`.

    python -m gpuswap.demo.train --steps 300 --step-time 0.05 --out result.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

import gpuswap

N_SAMPLES, N_FEATURES, BATCH = 1024, 16, 64


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return x, y


def make_model(hidden: int = 64) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, hidden), torch.nn.GELU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 1),
    )


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pick_device() -> str:
    simulated = os.environ.get("GPUSWAP_SIMULATED_GPU", "") not in ("", "0")
    return "cuda" if torch.cuda.is_available() and not simulated else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-time", type=float, default=0.0, help="sleep per step (seconds)")
    ap.add_argument("--out", help="write a JSON result (final parameter sha256, steps) here")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--hidden", type=int, default=64, help="hidden width (state grows with its square)")
    ap.add_argument("--log-every", type=int, default=0, help="progress line period (default steps/10)")
    args = ap.parse_args(argv)
    log_every = args.log_every or max(1, args.steps // 10)

    device = pick_device()
    if device == "cpu":
        torch.set_num_threads(1)  # a tiny model: threads only add contention on a shared box
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    x, y = (t.to(device) for t in make_data(args.seed))
    model = make_model(args.hidden).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.8)
    batches = torch.Generator().manual_seed(args.seed + 1)

    job = gpuswap.attach(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches)
    job.state.setdefault("loss_sum", 0.0)
    if job.start_step:
        print(f"train: resuming at step {job.start_step}", flush=True)

    loss = torch.zeros(())
    for step in range(job.start_step, args.steps):
        idx = torch.randint(0, N_SAMPLES, (BATCH,), generator=batches).to(device)
        jitter = 1.0 + 0.01 * random.random()
        model.train()
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[idx]) * jitter, y[idx])
        loss.backward()
        optimizer.step()
        scheduler.step()
        job.state["loss_sum"] += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == args.steps:
            print(f"train: step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        job.safepoint(step)

    result = {
        "sha256": params_sha256(model),
        "steps": args.steps,
        "start_step": job.start_step,
        "final_loss": loss.item(),
        "loss_sum": job.state["loss_sum"],
        "device": device,
        "inside_gpuswap": bool(getattr(job, "inside", False)),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"train: done, {args.steps} steps, params sha256 {result['sha256'][:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
