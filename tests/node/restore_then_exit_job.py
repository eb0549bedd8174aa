"""A tiny cooperative job that, once restarted from a disk checkpoint, restores and exits at once.

Usage: restore_then_exit_job.py GATE. First launch: attaches and trains (a safepoint every 20 ms)
until it is paused. Every later launch waits for the file GATE *before* attaching, then attaches
(restoring the checkpoint) and exits 0 without another step: the whole resume happens in one
instant the test chooses. Gives up waiting after 600 s."""
from __future__ import annotations

import os
import sys
import time

import torch

import gpuswap


def main() -> int:
    gate = sys.argv[1]
    started = os.path.join(os.path.dirname(gate), "restore_then_exit.started")
    if os.path.exists(started):
        deadline = time.monotonic() + 600
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
    with open(started, "w"):
        pass
    model = torch.nn.Linear(8, 8)
    job = gpuswap.attach(model=model)
    if job.start_step > 0:
        return 0
    for step in range(100000):
        with torch.no_grad():
            model.weight.add_(1.0)
        job.safepoint(step)
        time.sleep(0.02)
    return 1


if __name__ == "__main__":
    sys.exit(main())
