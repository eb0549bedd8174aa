"""Reading a job trace (CSV) into simulator jobs, filling missing memory footprints and classes.

Accepted columns (header names, case-insensitive; extra columns are ignored):
  submit time  `timestamp` | `submit_time` | `submit`   ISO date-time (UTC unless it names a zone) or seconds
  run time     `duration` | `duration_s`                  seconds of GPU work, > 0
  GPUs         `num_gpus` | `gpus`                        > 0; a fraction is rounded up (whole GPUs only)
  user         `user` | `cluster` (optional)              fair-share principal; Philly: virtual cluster
  class        `priority` | `class` (optional)            urgent|high|normal|low or 0..3
  memory       `mem` | `mem_bytes` | `memory` (optional)  per-GPU footprint, e.g. 12GiB or bytes
  weight       `weight` (optional)                        the user's fair-share weight (default 1)
  job name     `name` | `job_name` | `jobname` | `command` (optional)  the family the runtime predictor
               learns from (policy/estimate.py); without it, the GPUs asked for ("1 GPU", "8 GPUs"):
               Philly's rows name no job, and within a virtual cluster the width is what sets runs apart
Missing values are filled by documented, seeded models (see `fill_memory`, `assign_classes`).
Malformed rows are skipped and counted by reason; a class label outside the four classes refuses
the whole trace (dropping a class would silently simulate another workload).
"""
from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Optional

import numpy as np

from gpuswap.jobs import Priority, parse_size

GiB = 1024**3
MEM_MEDIAN_GIB = 12.0      # per-GPU footprint model: lognormal, median 12 GiB ...
MEM_SIGMA = 0.6            # ... spread (log-space std) ...
MEM_RANGE_GIB = (1.0, 78.0)  # ... clipped to what fits a current datacenter GPU
SHORT_JOB_S = 900.0        # jobs at most this long are candidates for the urgent class
# Bounds past which a row is nonsense, not a job: sums of such times lose every second to float
# precision (1e300 + 10 == 1e300: a JCT of 0), and the plots' exp() overflows.
MAX_ABS_TIME_S = 1e12      # submit times (seconds; ISO dates stop at year 9999, ~2.5e11)
MAX_DURATION = (1e9, "duration over 31 years")
MAX_GPUS = (1e6, "GPUs over a million")


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
    name: str = ""             # job family for runtime estimates (a name column, else the GPUs asked for)


@dataclass
class Trace:
    jobs: list[TraceJob]
    skipped: int = 0
    problems: list[str] = field(default_factory=list)   # per reason, most frequent first: "reason, e.g. line N: value"
    clamped: int = 0                                      # jobs wider than a node, narrowed
    skipped_by_reason: dict[str, int] = field(default_factory=dict)
    rounded: int = 0                                      # fractional GPU requests rounded up


class _BadRow(ValueError):
    """A malformed row: `reason` is the category it is counted under, the message an example."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


_ALIASES = {
    "submit": ("timestamp", "submit_time", "submit"),
    "duration": ("duration", "duration_s"),
    "gpus": ("num_gpus", "gpus"),
    "user": ("user", "cluster"),
    "priority": ("priority", "class"),
    "mem": ("mem", "mem_bytes", "memory"),
    "weight": ("weight",),
    "name": ("name", "job_name", "jobname", "command"),
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


def _show(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:30] + "...")


def _time(text: str) -> float:
    """Seconds, or an ISO date-time; one without a zone is read as UTC, so the trace means the same
    on every machine (local time would shift jobs by an hour across a daylight-saving change)."""
    try:
        value = float(text)
    except ValueError:
        try:
            t = datetime.fromisoformat(text.strip())
        except ValueError:
            raise _BadRow("bad submit time", _show(text)) from None
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(value):
        raise _BadRow("bad submit time", _show(text))
    if abs(value) > MAX_ABS_TIME_S:     # at 1e300 s, adding a job's duration changes nothing
        raise _BadRow("submit time beyond year 33,000", _show(text))
    return value


def _number(text: str, reason: str, most: Optional[tuple[float, str]] = None) -> float:
    """A finite number > 0; with `most` (bound, reason), one above the bound is a bad row too."""
    try:
        value = float(text)
    except ValueError:
        raise _BadRow(reason, _show(text)) from None
    if not math.isfinite(value) or value <= 0:
        raise _BadRow(reason, _show(text))
    if most is not None and value > most[0]:
        raise _BadRow(most[1], _show(text))
    return value


def _priority(text: str) -> int:
    """A class label: urgent/high/normal/low or 0..3. Anything else raises KeyError (not a bad
    row: the trace uses a vocabulary we do not know)."""
    text = text.strip()
    if text.isascii() and text.isdigit() and int(text) in [x.value for x in Priority]:
        return int(text)
    try:
        return int(Priority.parse(text))
    except ValueError:
        raise KeyError(text) from None


def read_trace(path: str, limit: Optional[int] = None) -> Trace:
    """Parse the CSV; malformed rows are skipped and counted by reason (with one example each).

    `limit` keeps the earliest jobs by submit time (files need not be sorted; Philly's is not)."""
    if limit is not None and limit < 1:
        raise TraceError(f"limit must be >= 1, got {limit}")
    try:
        fh = open(path, newline="")
    except OSError as e:
        raise TraceError(f"cannot open trace {path!r}: {e.strerror or e}") from None
    jobs: list[TraceJob] = []
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    unknown_classes: Counter[str] = Counter()
    rounded: set[str] = set()             # jobs whose fractional GPU request was rounded up
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
                duration = _number(get("duration"), "duration not a positive number", MAX_DURATION)
                gpus_asked = _number(get("gpus"), "GPUs not a positive number", MAX_GPUS)
                gpus = math.ceil(gpus_asked)
                prio = _priority(get("priority")) if get("priority").strip() else None
                try:
                    mem = parse_size(get("mem")) if get("mem").strip() else None
                except ValueError:
                    raise _BadRow("bad memory size", _show(get("mem"))) from None
                weight = _number(get("weight"), "weight not a positive number") if get("weight").strip() else 1.0
            except KeyError as e:
                unknown_classes[e.args[0]] += 1
                continue
            except _BadRow as e:
                reasons[e.reason] += 1
                examples.setdefault(e.reason, f"line {lineno}: {e.detail}")
                continue
            if gpus != gpus_asked:
                rounded.add(str(len(jobs)))
            name = get("name").strip() or f"{gpus} GPU{'s' if gpus > 1 else ''}"
            jobs.append(TraceJob(str(len(jobs)), submit, duration, gpus,
                                 get("user").strip() or "user", prio, mem, weight, name))
    if unknown_classes:
        labels = ", ".join(f"{_show(label)} ({n} row{'s' if n > 1 else ''})" for label, n in unknown_classes.most_common())
        raise TraceError(f"trace {path!r}: unknown class label(s) {labels}; the class column takes "
                         "urgent, high, normal, low or 3..0")
    skipped = sum(reasons.values())
    problems = [f"{r}, e.g. {examples[r]}" for r, _ in reasons.most_common()]
    if not jobs:
        detail = f" ({'; '.join(problems)})" if problems else ""
        raise TraceError(f"trace {path!r} has no usable rows; {skipped} skipped{detail}")
    jobs.sort(key=lambda j: (j.submit, int(j.id)))
    if limit is not None:
        del jobs[limit:]                  # the first `limit` jobs by submit time (a contiguous window)
    n_rounded = sum(j.id in rounded for j in jobs)
    t0 = jobs[0].submit
    for i, j in enumerate(jobs):
        j.submit -= t0
        j.id = str(i)
    return Trace(jobs, skipped, problems, skipped_by_reason=dict(reasons.most_common()), rounded=n_rounded)


def describe_skipped(trace: Trace) -> str:
    """One line: how many rows were skipped, by reason, each with its first example."""
    parts = [f"{n} {example}" for n, example in zip(trace.skipped_by_reason.values(), trace.problems)]
    return f"skipped {trace.skipped} malformed row(s): " + "; ".join(parts)


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
