"""Vocabulary shared by every part: job states, priority classes, parking tiers, sizes.

Kept free of I/O so the policy, the daemon, the runtime and the simulator can all import it.
"""
from __future__ import annotations

import enum
import re
from decimal import Decimal

from gpuswap.exitcodes import EX_TEMPFAIL


class JobState(str, enum.Enum):
    """Slurm-like job states. The string value is what the API and the database hold."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSING = "PAUSING"
    PAUSED = "PAUSED"
    RESUMING = "RESUMING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


# The ended states by the names the API and the database hold: the one list for code that reads
# a job as JSON or SQL (the dashboard's JavaScript keeps its own copy).
ENDED = frozenset(s.value for s in JobState if s.terminal)


class Priority(int, enum.Enum):
    """Priority classes; a higher value wins."""

    LOW = 0
    NORMAL = 1
    HIGH = 2
    URGENT = 3

    @classmethod
    def parse(cls, text: str) -> "Priority":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(
                f"unknown priority {text!r}; use one of: urgent, high, normal, low"
            ) from None

    @property
    def label(self) -> str:
        return self.name.lower()


# Exit code a job's runtime uses after writing a disk checkpoint: "requeue me" (exitcodes.py).
REQUEUE_EXIT_CODE = EX_TEMPFAIL

MAX_SIZE = 2**50     # 1 PiB: no GPU or host memory comes near it
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pib": 1024**5, "pi": 1024**5,
}


def parse_size(text: str) -> int:
    """'20GiB' -> 21474836480. Decimal (GB) and binary (GiB) units; plain numbers are bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read size {_short(str(text))}; write e.g. 20GiB, 512MiB or 80GB")
    number, unit = m.group(1), (m.group(2) or "").lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {_short(text)}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB)")
    # Exact decimal arithmetic, bounded before conversion: a float would overflow to inf (or lose
    # digits) on a 400-digit number.
    if len(number.split(".")[0]) > 30 or (size := int(Decimal(number) * _UNITS[unit])) > MAX_SIZE:
        raise ValueError(f"size {_short(text)} is too large; the most is {format_size(MAX_SIZE)}")
    return size


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:20] + "..." + text[-10:])


def format_size(n: int | float | None) -> str:
    """Bytes for people, binary units: 21474836480 -> '20.0 GiB'."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


MAX_TIME_LIMIT_S = 365 * 86400
_SLURM_TIME = re.compile(r"^(?:(\d{1,4})-)?(\d{1,7})(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_UNIT_TIME = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time_limit(text: str) -> float:
    """A run-time estimate as Slurm's `--time` takes it, in seconds: "minutes", "minutes:seconds",
    "hours:minutes:seconds", "days-hours", "days-hours:minutes", "days-hours:minutes:seconds";
    and 90s, 30m, 4h, 1.5d. Must be > 0 and at most a year."""
    t = str(text).strip().lower()
    m = _UNIT_TIME.match(t)
    if m:
        seconds = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    else:
        m = _SLURM_TIME.match(t)
        if not m:
            raise ValueError(f"cannot read time {_short(str(text))}; write e.g. 4h, 90m, 1d, 2:30:00 or 1-12")
        days, a, b, c = m.groups()
        a, b, c = int(a), (int(b) if b is not None else None), (int(c) if c is not None else None)
        if days is not None:            # days-hours[:minutes[:seconds]]
            seconds = int(days) * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
        elif c is not None:             # hours:minutes:seconds
            seconds = a * 3600 + b * 60 + c
        elif b is not None:             # minutes:seconds
            seconds = a * 60 + b
        else:                           # minutes
            seconds = a * 60
    if not seconds > 0:
        raise ValueError(f"time {_short(str(text))} must be more than 0")
    if seconds > MAX_TIME_LIMIT_S:
        raise ValueError(f"time {_short(str(text))} is more than a year")
    return float(seconds)
