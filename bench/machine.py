"""What every benchmark prints about the machine it ran on (its table's title and JSON)."""
from __future__ import annotations

import os
import platform
import time
from typing import Callable


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """CPU model, cores and Python: enough to tell two benchmark runs' machines apart."""
    return f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """`fn`'s CPU seconds, `repeat` times: CPU time, so that a loaded machine's waiting for a core
    is left out (compare ratios against a reference timed the same way, not seconds)."""
    out = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        out.append(time.process_time() - t0)
    return out
