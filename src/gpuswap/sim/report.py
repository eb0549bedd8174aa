"""Presenting results: a rich table on the terminal, summary.json/CSV and PNG plots in --out."""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Optional

import numpy as np

from gpuswap.fsutil import atomic_write_json
from gpuswap.jobs import Priority
from gpuswap.sim.engine import SimResult
from gpuswap.sim.metrics import arrays

COLUMNS = [("avg_jct_s", "avg JCT"), ("p50_jct_s", "p50 JCT"), ("p95_jct_s", "p95 JCT"),
           ("p99_jct_s", "p99 JCT"), ("avg_queue_s", "avg queue"), ("p99_queue_s", "p99 queue"),
           ("p99_queue_urgent_s", "p99 queue urgent"), ("makespan_s", "makespan"),
           ("utilization", "util"), ("preemptions_per_job", "preempt/job"),
           ("switch_gpu_s", "switch GPU-h"), ("fairness_jain", "fairness")]


def fmt(key: str, v: Optional[float]) -> str:
    if v is None:
        return "-"
    if key == "utilization":
        return f"{v:.1%}"
    if key in ("preemptions_per_job", "fairness_jain"):
        return f"{v:.3f}"
    if key == "switch_gpu_s":
        return f"{v / 3600:,.1f}"
    if key == "makespan_s":
        return f"{v / 86400:,.1f} d"
    return f"{v:,.0f} s"


def print_table(summaries: dict[str, dict[str, Any]], title: str) -> None:
    from rich.table import Table

    from gpuswap.terminal import PipeConsole

    table = Table(title=title)
    table.add_column("policy")
    for _, head in COLUMNS:
        table.add_column(head, justify="right")
    for name, s in summaries.items():
        table.add_row(name, *(fmt(k, s.get(k)) for k, _ in COLUMNS))
    console = PipeConsole()
    if console.width < 170:
        console = PipeConsole(width=170)   # a results table is more useful unwrapped than cut
    console.print(table)


def write_outputs(out: str, summaries: dict[str, dict[str, Any]], results: dict[str, SimResult],
                  meta: dict[str, Any]) -> list[str]:
    os.makedirs(out, exist_ok=True)
    written = []
    path = os.path.join(out, "summary.json")
    atomic_write_json(path, {**summaries, "_meta": meta} if meta else summaries)
    written.append(path)
    path = os.path.join(out, "summary.csv")
    keys = [k for k, _ in COLUMNS] + ["preemptions", "p50_queue_s", "p95_queue_s", "decide_calls"]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["policy", *keys])
        for name, s in summaries.items():
            w.writerow([name, *(s.get(k) for k in keys)])
    written.append(path)
    for name, r in results.items():
        path = os.path.join(out, f"jobs_{name}.csv")
        with open(path, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["id", "user", "class", "gpus", "submit_s", "duration_s", "first_start_s",
                        "end_s", "jct_s", "queue_s", "preemptions", "switch_s", "estimate_s", "estimate_from"])
            for j in r.jobs:
                s = j.spec
                w.writerow([s.id, s.user, Priority(s.priority).label, s.gpus, s.submit, s.duration,
                            j.first_start, j.end, j.end - s.submit, j.first_start - s.submit,
                            j.preemptions, round(j.switch_s, 3),
                            j.estimate.seconds if j.estimate else None, j.estimate.source if j.estimate else None])
        written.append(path)
    written += plots(out, results)
    return written


def plots(out: str, results: dict[str, SimResult]) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", "-.", ":"]
    for i, (name, r) in enumerate(results.items()):
        jct = np.sort(arrays(r)["jct"])
        ours = name == "gpuswap"            # drawn on top and thicker: close curves hide each other
        ax.plot(np.maximum(jct, 1), np.arange(1, jct.size + 1) / jct.size, label=name,
                linestyle="-" if ours else styles[i % len(styles)], linewidth=2.2 if ours else 1.3,
                zorder=3 if ours else 2)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("JCT CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(os.path.join(out, "jct_cdf.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(results)
    classes = sorted({j.spec.priority for r in results.values() for j in r.jobs}, reverse=True)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        a = arrays(results[name])
        means = [max(float(a["queue"][a["prio"] == p].mean()), 0.1) for p in classes]
        ax.bar(np.arange(len(classes)) + i * width, means, width, label=name)
    ax.set_xticks(np.arange(len(classes)) + width * (len(names) - 1) / 2)
    ax.set_xticklabels([Priority(p).label for p in classes])
    ax.set_yscale("log")
    ax.set_ylabel("mean queueing delay (s)")
    ax.set_title("Queueing delay per class")
    ax.legend(fontsize=8)
    paths.append(os.path.join(out, "queue_by_class.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def markdown(summaries: dict[str, dict[str, Any]]) -> str:
    """The same table as Markdown, for docs (`python -m gpuswap.sim.report summary.json`)."""
    lines = ["| policy | " + " | ".join(h for _, h in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for name, s in summaries.items():
        if not name.startswith("_"):
            lines.append(f"| {name} | " + " | ".join(fmt(k, s.get(k)) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    with open(sys.argv[1]) as fh:
        print(markdown(json.load(fh)))
