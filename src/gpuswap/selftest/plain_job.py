"""The selftest's unmodified job: a deterministic PyTorch loop that never imports gpuswap, run as
`sh -c 'python plain_job.py ...; exit $?'` so its CUDA process is a child of the shell (as with
`bash run.sh`), and parked transparently through the CUDA driver's checkpoint API.

    python plain_job.py --bytes N --steps S --hold-at K --gate G --marker M --out RESULT.json

It holds N bytes on the GPU (a parameter vector and a same-sized optimizer-like state), runs S
steps of elementwise updates that draw from torch's global RNG each step, and writes the sha256 of
both tensors to RESULT.json. At step K it empties the CUDA caching allocator, writes MARKER
({"pid", "ppid"}) and waits (making no CUDA call, so the driver can lock it) until GATE exists;
with GATE already present (the uninterrupted reference) it never waits.

On simulated GPUs (the daemon sets GPUSWAP_SIMULATED_GPU=1 and GPUSWAP_SIM_CUDA_DIR) CPU tensors
stand in and the process registers itself as a simulated CUDA process holding N bytes, the one
thing it takes from gpuswap: `gpuswap.simcuda` is the stand-in for the CUDA driver (which adds the
process's CUDA context beside the N bytes, as NVML lists a real process with its context), and each
step makes a simulated CUDA call, which blocks while the simulated driver holds the process.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch

from gpuswap.fsutil import atomic_write_json

HOLD_LIMIT_S = 3600.0


def _write_atomic(path: str, obj: dict) -> None:
    atomic_write_json(path, obj)     # gpuswap's file helper only: the script stays unmodified for the driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--hold-at", type=int, required=True)
    ap.add_argument("--gate", required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)

    simulated = os.environ.get("GPUSWAP_SIMULATED_GPU", "") not in ("", "0")
    device = "cpu" if simulated else "cuda"
    sim = None
    if simulated and os.environ.get("GPUSWAP_SIM_CUDA_DIR"):   # under the daemon's simulated GPUs
        from gpuswap import simcuda as sim
        sim.allocate(a.bytes)
    if simulated:
        torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    n = max(4096, a.bytes // 8)                 # two float32 tensors of n elements: N bytes
    w = torch.randn(n, device=device) * 0.01
    state = torch.zeros_like(w)
    for step in range(a.steps):
        if step == a.hold_at and not os.path.exists(a.gate):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            _write_atomic(a.marker, {"pid": os.getpid(), "ppid": os.getppid(), "step": step})
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not os.path.exists(a.gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        if sim is not None:
            sim.sync()
        r = torch.randn(4096, device=device)
        g = torch.sin(w[:4096] * r).sum() * 1e-3
        w.mul_(0.999).add_(g)
        state.mul_(0.9).add_(w, alpha=0.1)
        if device == "cuda":
            torch.cuda.synchronize()
    h = hashlib.sha256()
    for t in (w, state):
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    _write_atomic(a.out, {"sha256": h.hexdigest(), "device": device, "steps": a.steps})
    print(f"plain job: done, {a.steps} steps, sha256 {h.hexdigest()[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
