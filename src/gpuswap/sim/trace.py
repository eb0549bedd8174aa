"""Reading a job trace (CSV) into simulator jobs, filling missing memory footprints and classes.

Accepted columns (header names, case-insensitive; extra columns are ignored):
  submit time  `timestamp` | `submit_time` | `submit`   ISO date-time or seconds (number)
  run time     `duration` | `duration_s`                  seconds of GPU work, > 0
  GPUs         `num_gpus` | `gpus`                        integer >= 1
  user         `user` | `cluster` (optional)              fair-share principal; Philly: virtual cluster
  class        `priority` | `class` (optional)            urgent|high|normal|low or 0..3
  memory       `mem` | `mem_bytes` | `memory` (optional)  per-GPU footprint, e.g. 12GiB or bytes
  weight       `weight` (optional)                        the user's fair-share weight (default 1)
Missing values are filled by documented, seeded models (see `fill_memory`, `assign_classes`).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Optional

import numpy as np

from gpuswap.jobs import Priority, parse_size

GiB = 1024**3
MEM_MEDIAN_GIB = 12.0      # per-GPU footprint model: lognormal, median 12 GiB ...
MEM_SIGMA = 0.6            # ... spread (log-space std) ...
MEM_RANGE_GIB = (1.0, 78.0)  # ... clipped to what fits a current datacenter GPU
SHORT_JOB_S = 900.0        # jobs at most this long are candidates for the urgent class


class TraceError(ValueError):
    """A trace that cannot be used at all (missing file, no recognisable columns, no usable rows)."""


@dataclass(slots=True)
class TraceJob:
    id: str
    submit: float              # seconds from the first submission
    duration: float            # seconds of work at full speed
    gpus: int
    user: str
    priority: Optional[int] = None
    mem: Optional[int] = None  # bytes per GPU
    weight: float = 1.0


@dataclass
class Trace:
    jobs: list[TraceJob]
    skipped: int = 0
    problems: list[str] = field(default_factory=list)   # first few reasons rows were skipped
    clamped: int = 0                                      # jobs wider than a node, narrowed


_ALIASES = {
    "submit": ("timestamp", "submit_time", "submit"),
    "duration": ("duration", "duration_s"),
    "gpus": ("num_gpus", "gpus"),
    "user": ("user", "cluster"),
    "priority": ("priority", "class"),
    "mem": ("mem", "mem_bytes", "memory"),
    "weight": ("weight",),
}


def _columns(header: list[str]) -> dict[str, str]:
    low = {h.strip().lower(): h for h in header}
    found = {}
    for key, names in _ALIASES.items():
        for n in names:
            if n in low:
                found[key] = low[n]
                break
    missing = [k for k in ("submit", "duration", "gpus") if k not in found]
    if missing:
        raise TraceError(f"trace header {header} lacks required column(s): "
                         + ", ".join("/".join(_ALIASES[m]) for m in missing))
    return found


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.strip()).timestamp()


def _priority(text: str) -> int:
    text = text.strip()
    if text.isdigit():
        p = int(text)
        if p not in [x.value for x in Priority]:
            raise ValueError(f"priority {p} not in 0..3")
        return p
    return int(Priority.parse(text))


def read_trace(path: str, limit: Optional[int] = None) -> Trace:
    """Parse the CSV; malformed rows are skipped and counted (the first few reasons are kept).

    `limit` keeps the earliest jobs by submit time (files need not be sorted; Philly's is not)."""
    try:
        fh = open(path, newline="")
    except OSError as e:
        raise TraceError(f"cannot open trace {path!r}: {e.strerror or e}") from None
    jobs: list[TraceJob] = []
    skipped = 0
    problems: list[str] = []
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header:
            raise TraceError(f"trace {path!r} is empty")
        cols = _columns(header)
        idx = {k: header.index(v) for k, v in cols.items()}
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            try:
                get = lambda k: row[idx[k]] if k in idx and idx[k] < len(row) else ""  # noqa: E731
                submit = _time(get("submit"))
                duration = float(get("duration"))
                gpus = int(float(get("gpus")))
                if not math.isfinite(submit) or not math.isfinite(duration) or duration <= 0:
                    raise ValueError(f"duration must be a positive number, got {get('duration')!r}")
                if gpus < 1:
                    raise ValueError(f"GPUs must be >= 1, got {gpus}")
                prio = _priority(get("priority")) if get("priority").strip() else None
                mem = parse_size(get("mem")) if get("mem").strip() else None
                weight = float(get("weight")) if get("weight").strip() else 1.0
                if weight <= 0:
                    raise ValueError(f"weight must be > 0, got {weight}")
            except (ValueError, IndexError, OverflowError) as e:
                skipped += 1
                if len(problems) < 5:
                    problems.append(f"line {lineno}: {e}")
                continue
            jobs.append(TraceJob(str(len(jobs)), submit, duration, gpus,
                                 get("user").strip() or "user", prio, mem, weight))
    if not jobs:
        detail = f" ({'; '.join(problems)})" if problems else ""
        raise TraceError(f"trace {path!r} has no usable rows; {skipped} skipped{detail}")
    jobs.sort(key=lambda j: (j.submit, int(j.id)))
    if limit is not None:
        del jobs[limit:]                  # the first `limit` jobs by submit time (a contiguous window)
    t0 = jobs[0].submit
    for i, j in enumerate(jobs):
        j.submit -= t0
        j.id = str(i)
    return Trace(jobs, skipped, problems)


def fill_memory(jobs: list[TraceJob], seed: int) -> None:
    """Jobs without a footprint get one per GPU: lognormal (median 12 GiB, sigma 0.6) clipped to 1..78 GiB."""
    rng = np.random.default_rng([seed, 1])
    draws = np.exp(rng.normal(math.log(MEM_MEDIAN_GIB), MEM_SIGMA, size=len(jobs)))
    draws = np.clip(draws, *MEM_RANGE_GIB)
    for j, gib in zip(jobs, draws):
        if j.mem is None:
            j.mem = int(gib * GiB)


def assign_classes(jobs: list[TraceJob], urgent_fraction: float, seed: int) -> None:
    """Jobs without a class: each job of at most 15 minutes is urgent with probability `urgent_fraction`
    (interactive/debug runs are short); all others are normal. Seeded, so runs reproduce."""
    rng = np.random.default_rng([seed, 2])
    coins = rng.random(len(jobs))
    for j, c in zip(jobs, coins):
        if j.priority is None:
            j.priority = int(Priority.URGENT if (j.duration <= SHORT_JOB_S and c < urgent_fraction)
                             else Priority.NORMAL)


def fit_to_nodes(trace: Trace, gpus_per_node: int) -> None:
    """A job needs all its GPUs on one node; wider jobs are narrowed to a node and run longer by the
    same factor, keeping their GPU-time (counted in `trace.clamped`)."""
    for j in trace.jobs:
        if j.gpus > gpus_per_node:
            j.duration *= j.gpus / gpus_per_node
            j.gpus = gpus_per_node
            trace.clamped += 1


def load(path: str, seed: int = 0, urgent_fraction: float = 0.1, gpus_per_node: int = 8,
         limit: Optional[int] = None) -> Trace:
    trace = read_trace(path, limit)
    fit_to_nodes(trace, gpus_per_node)
    fill_memory(trace.jobs, seed)
    assign_classes(trace.jobs, urgent_fraction, seed)
    return trace
