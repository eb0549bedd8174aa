"""The selftest's cooperative job: the demo training script (`gpuswap.demo.train`, which uses
`gpuswap.attach` and `safepoint`), unchanged except that from step HOLD_AT on its safepoint does
not return until the selftest creates GATE.

    python -m gpuswap.selftest.coop_job --gate G --marker M --hold-at K -- [demo.train args]

Why the hold: the selftest must measure the job before, during and after a park at one and the
same point of its run, and must never race the job's end, however slow the machine. While held
the job keeps reaching its safepoint (so it can be paused, parked and resumed there) and trains
nothing, so its final parameters are bitwise those of the run that was never held. On first
reaching the hold it empties the CUDA caching allocator (what AdamW's temporaries left cached) and
only then writes MARKER ({"pid", "step"}): NVML's "before" and "after" then compare the same
things, the attached tensors and the CUDA context, not whatever the allocator happened to cache.
The run with GATE already present (the selftest's uninterrupted reference) never holds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from gpuswap.demo import train
from gpuswap.fsutil import atomic_write_json

HOLD_LIMIT_S = 3600.0   # a selftest that died leaves no job held for ever


class Held:
    """The runtime's job handle with a safepoint that holds from step `hold_at` until `gate` exists."""

    def __init__(self, job: Any, gate: str, marker: str, hold_at: int):
        self._job, self._gate, self._marker, self._hold_at = job, gate, marker, hold_at
        self._marked = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._job, name)

    def safepoint(self, step: int) -> None:
        self._job.safepoint(step)
        if step < self._hold_at or os.path.exists(self._gate):
            return
        if not self._marked:
            _release_allocator_cache()
            atomic_write_json(self._marker, {"pid": os.getpid(), "step": step}, 0o644)
            self._marked = True
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not os.path.exists(self._gate) and time.monotonic() < deadline:
            time.sleep(0.02)
            self._job.safepoint(step)


def _release_allocator_cache() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", required=True)
    ap.add_argument("--marker", required=True)
    ap.add_argument("--hold-at", type=int, required=True)
    ap.add_argument("train_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    rest = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
    attach = train.gpuswap.attach
    train.gpuswap.attach = lambda *o, **kw: Held(attach(*o, **kw), a.gate, a.marker, a.hold_at)
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())
