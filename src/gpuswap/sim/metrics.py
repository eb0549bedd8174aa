"""Turning a finished simulation into the figures the issue asks for (pure numpy, no I/O)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from gpuswap.jobs import Priority
from gpuswap.sim.engine import SimResult


def _pct(a: np.ndarray, q: float) -> Optional[float]:
    return float(np.percentile(a, q)) if a.size else None


def _stats(jct: np.ndarray, queue: np.ndarray) -> dict[str, Any]:
    return {
        "jobs": int(jct.size),
        "avg_jct_s": float(jct.mean()) if jct.size else None,
        "p50_jct_s": _pct(jct, 50), "p95_jct_s": _pct(jct, 95), "p99_jct_s": _pct(jct, 99),
        "avg_queue_s": float(queue.mean()) if queue.size else None,
        "p50_queue_s": _pct(queue, 50), "p95_queue_s": _pct(queue, 95), "p99_queue_s": _pct(queue, 99),
    }


def jain(x: np.ndarray) -> Optional[float]:
    """Jain's fairness index: 1 when all values are equal, 1/n when one user takes everything."""
    if not x.size or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * (x ** 2).sum()))


def arrays(r: SimResult) -> dict[str, np.ndarray]:
    submit = np.array([j.spec.submit for j in r.jobs])
    return {
        "jct": np.array([j.end for j in r.jobs]) - submit,
        "queue": np.array([j.first_start for j in r.jobs]) - submit,
        "prio": np.array([j.spec.priority for j in r.jobs]),
        "gpus": np.array([j.spec.gpus for j in r.jobs]),
        "duration": np.array([j.spec.duration for j in r.jobs]),
        "preemptions": np.array([j.preemptions for j in r.jobs]),
    }


def summarize(r: SimResult) -> dict[str, Any]:
    """Headline figures: JCT and queueing delay (submit to first start) overall and per class,
    makespan, utilization (useful GPU-seconds / GPUs x makespan), preemptions, GPU-time lost to
    switching, and per-user fairness (Jain's index over users' mean slowdown, JCT / run time)."""
    a = arrays(r)
    out: dict[str, Any] = {"policy": r.policy, "switch_cost": r.cost_model}
    out.update(_stats(a["jct"], a["queue"]))
    urgent = a["prio"] == int(Priority.URGENT)
    out["p99_queue_urgent_s"] = _pct(a["queue"][urgent], 99)
    gpus = r.cluster.nodes * r.cluster.gpus_per_node
    out["makespan_s"] = r.makespan
    out["utilization"] = r.busy_gpu_s / (gpus * r.makespan) if r.makespan > 0 else None
    out["preemptions"] = int(a["preemptions"].sum())
    out["preemptions_per_job"] = float(a["preemptions"].mean())
    out["switch_gpu_s"] = r.switch_gpu_s
    slowdown: dict[str, list[float]] = {}
    for j, s in zip(r.jobs, a["jct"] / a["duration"]):
        slowdown.setdefault(j.spec.user, []).append(float(s))
    out["fairness_jain"] = jain(np.array([np.mean(v) for _, v in sorted(slowdown.items())]))
    out["per_class"] = {
        Priority(p).label: _stats(a["jct"][a["prio"] == p], a["queue"][a["prio"] == p])
        for p in sorted(set(a["prio"].tolist()), reverse=True)
    }
    wide = a["gpus"] >= 2                   # the jobs reservations are for (issue 15, item 2)
    out["wide"] = _stats(a["jct"][wide], a["queue"][wide]) | {"p90_queue_s": _pct(a["queue"][wide], 90),
                                                              "jobs": int(wide.sum())}
    out["decide_calls"] = r.decide_calls
    out["events"] = r.events
    out["max_waiting"] = r.max_waiting
    return out
