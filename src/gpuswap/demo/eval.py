"""Demo "urgent eval": a few seconds of GPU (or CPU) work, then one result line, exit 0.

    python -m gpuswap.demo.eval --seconds 3
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="how long to evaluate")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(args.seed)
    w = torch.randn(256, 10, generator=g).to(device)
    correct = total = 0
    t0 = time.monotonic()
    with torch.no_grad():
        while True:
            x = torch.randn(512, 256, generator=g).to(device)
            labels = (x @ w).argmax(dim=1)
            noisy = (x + 0.5 * torch.randn(512, 256, generator=g).to(device)) @ w
            correct += int((noisy.argmax(dim=1) == labels).sum())
            total += labels.numel()
            if time.monotonic() - t0 >= args.seconds:
                break
    print(f"eval: accuracy {correct / total:.4f} on {total} samples ({device}, "
          f"{time.monotonic() - t0:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
