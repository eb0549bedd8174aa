"""Transparent parking on a real GPU: freeze/thaw of an unmodified PyTorch process holding 4 and
16 GiB through gpuswap's driver path (the same CudaCheckpointDriver the daemon uses), next to a
plain pinned copy of the same bytes measured in the same run, with NVML's view of the process's
memory while frozen and a bitwise check that training continued exactly.

    python bench/bench_parking.py [--sizes 4,16]

Needs an NVIDIA GPU, driver >= 570 and cuda-bindings >= 13.0.3; without them it says so and exits 0.
The cooperative path (gpuswap.attach) on the same sizes is measured by bench/bench_safepoint.py.
Published reference: cuda-checkpoint froze 3.6 GB in 1.3 s (2.7 GB/s) and thawed in 0.83 s on an H100 PCIe.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

# An unmodified training script: no gpuswap import. Holds SIZE bytes of parameters on the GPU,
# runs STEPS deterministic steps (sleeping a little so a freeze lands mid-run), prints a hash.
CHILD = r'''
import hashlib, sys, time, torch
size, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
n = size // 4
w = torch.randn(n, device="cuda") * 0.01
opt_state = torch.zeros_like(w)
x = torch.randn(4096, device="cuda")
print("ready", flush=True)
for step in range(steps):
    g = torch.sin(w[:4096] * x).sum() * 1e-3
    w.mul_(0.999).add_(g)
    opt_state.add_(w, alpha=0.1)
    torch.cuda.synchronize()
    time.sleep(0.01)
h = hashlib.sha256(w.cpu().numpy().tobytes() + opt_state.cpu().numpy().tobytes()).hexdigest()
print("hash", h, flush=True)
'''


def nvml_used(pid: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
    return total


def pinned_copy(nbytes: int) -> tuple[float, float]:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t0
    del dev, host
    torch.cuda.empty_cache()
    return d2h, h2d


def run_child(script: Path, nbytes: int, steps: int, driver=None) -> dict:
    p = subprocess.Popen([sys.executable, str(script), str(nbytes), str(steps)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    out: dict = {}
    if driver is not None:
        time.sleep(0.5)
        out["before"] = nvml_used(p.pid)
        t0 = time.perf_counter()
        driver.lock(p.pid, 10_000)
        out["lock_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        driver.checkpoint(p.pid)
        out["checkpoint_s"] = time.perf_counter() - t0
        time.sleep(0.5)
        out["frozen"] = nvml_used(p.pid)
        t0 = time.perf_counter()
        driver.restore(p.pid)
        out["restore_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        driver.unlock(p.pid)
        out["unlock_s"] = time.perf_counter() - t0
    for line in p.stdout:
        if line.startswith("hash"):
            out["hash"] = line.split()[1]
    p.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,16", help="GiB, comma-separated")
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    console = Console()
    try:
        from gpuswap.node import cuda_ckpt
        from gpuswap.node.gpus import NvmlGpus

        gpus = NvmlGpus()
        cap = cuda_ckpt.detect(gpus.persistence(), gpus.driver)
        if not cap.available:
            raise RuntimeError(cap.reason)
        driver = cuda_ckpt.CudaCheckpointDriver(cap)
        name = gpus.list()[0].name
    except Exception as e:
        console.print(f"bench_parking needs a GPU with the driver checkpoint API: {e}")
        return 0
    script = Path(tempfile.mkdtemp()) / "child.py"
    script.write_text(CHILD)
    t = Table(title=f"transparent parking vs pinned copy — {name}, driver {cap.driver}, cuda-bindings {cap.bindings}")
    for col in ("GiB", "pinned D2H GB/s", "freeze (lock+ckpt) s", "freeze GB/s", "ratio vs pinned",
                "pinned H2D GB/s", "thaw (restore+unlock) s", "thaw GB/s", "NVML before → frozen", "bitwise"):
        t.add_column(col)
    for gib in (float(s) for s in a.sizes.split(",")):
        nbytes = int(gib * 2**30)
        d2h, h2d = pinned_copy(nbytes)
        ref = run_child(script, nbytes, a.steps)
        r = run_child(script, nbytes, a.steps, driver)
        freeze = r["lock_s"] + r["checkpoint_s"]
        thaw = r["restore_s"] + r["unlock_s"]
        t.add_row(f"{gib:g}", f"{nbytes / d2h / 1e9:.1f}", f"{freeze:.2f}", f"{nbytes / freeze / 1e9:.1f}",
                  f"{(nbytes / freeze) / (nbytes / d2h):.2f}", f"{nbytes / h2d / 1e9:.1f}", f"{thaw:.2f}",
                  f"{nbytes / thaw / 1e9:.1f}", f"{r['before'] / 2**30:.1f} → {r['frozen'] / 2**30:.2f} GiB",
                  "yes" if r.get("hash") == ref.get("hash") else "NO")
    console.print(t)
    console.print("reference (published): cuda-checkpoint freeze 3.6 GB in 1.3 s (2.7 GB/s), thaw 0.83 s, H100 PCIe")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sys.exit(main())
