"""`python held_train.py GATE HOLD_AT [--keep-pace] [gpuswap.demo.train args]`: the demo training
job, unchanged, except that from step HOLD_AT on its safepoint does not return until the test
creates the file GATE (it keeps reaching that safepoint meanwhile, so it can be paused, parked and
resumed there).

Why: a test that pauses or preempts a training job must not race the job's end. With this, the job
cannot finish before the test lets it, however slow the machine; no training happens while it is
held, so its final parameters are bitwise those of the plain run. HOLD_AT should be at most
steps - 2, so that a job restarted from a disk checkpoint taken at the held step still has a step
to run, and holds again at its safepoint. Gives up holding after 600 s (a failed test leaves
nothing that waits forever).

Once GATE exists, the per-step sleep (`--step-time`) is skipped: it is there only so that a test
sees the job at work before it lets it go, and after that the test only waits for the end. The
steps, and so the final parameters, are the same; only the idle time between them goes (seconds
per test). `--keep-pace` keeps the sleep to the end, for a test that still watches the job run
after opening the gate (one that kills the daemon at a random moment of the rest of the run)."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import gpuswap
from gpuswap.demo import train


class Held:
    """The runtime's job handle with a safepoint that holds from step `hold_at` until `gate` exists."""

    def __init__(self, job: Any, gate: str, hold_at: int):
        self._job, self._gate, self._hold_at = job, gate, hold_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def safepoint(self, step: int) -> None:
        self._job.safepoint(step)
        deadline = time.monotonic() + 600
        while step >= self._hold_at and not os.path.exists(self._gate) and time.monotonic() < deadline:
            time.sleep(0.02)
            self._job.safepoint(step)


class PacedUntilOpen:
    """The demo's `time` module, but its `sleep` returns at once once `gate` exists."""

    def __init__(self, gate: str):
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        if not os.path.exists(self._gate):
            time.sleep(seconds)


def main() -> int:
    gate, hold_at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if argv[:1] == ["--keep-pace"]:
        argv = argv[1:]
    else:
        train.time = PacedUntilOpen(gate)       # train sleeps only for --step-time
    attach = gpuswap.attach
    gpuswap.attach = lambda *a, **kw: Held(attach(*a, **kw), gate, hold_at)   # train calls gpuswap.attach
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
