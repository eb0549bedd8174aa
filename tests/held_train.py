"""`python held_train.py GATE HOLD_AT [gpuswap.demo.train args]`: the demo training job, unchanged,
except that from step HOLD_AT on its safepoint does not return until the test creates the file
GATE (it keeps reaching that safepoint meanwhile, so it can be paused, parked and resumed there).

Why: a test that pauses or preempts a training job must not race the job's end. With this, the job
cannot finish before the test lets it, however slow the machine; no training happens while it is
held, so its final parameters are bitwise those of the plain run. HOLD_AT should be at most
steps - 2, so that a job restarted from a disk checkpoint taken at the held step still has a step
to run, and holds again at its safepoint. Gives up holding after 600 s (a failed test leaves
nothing that waits forever)."""
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


def main() -> int:
    gate, hold_at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    attach = gpuswap.attach
    gpuswap.attach = lambda *a, **kw: Held(attach(*a, **kw), gate, hold_at)   # train calls gpuswap.attach
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
