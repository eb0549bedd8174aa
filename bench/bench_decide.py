"""Benchmark one policy decision with a deep queue: 10,000 waiting jobs on 64x8 GPUs.

    python bench/bench_decide.py [--policies gpuswap,las] [--waiting 10000] [--nodes 64] [--repeat 7]
                                 [--class-floor SHARE]

The goal (issue 15 item 6) is one decision in at most 20 ms. Each snapshot is built once, seeded,
and decided `--repeat` times per policy; the table gives the fastest and the median, the number of
decisions, and the ratio of the median to a reference measured in the same run: sorting the
waiting jobs once by (submit time, id), the floor any policy that orders its queue pays in Python.
Times are the process's CPU time (equal to wall time on a quiet machine; on a shared one they leave
out the time spent waiting for a CPU). Compare ratios, not milliseconds, between machines.

Scenarios (every cluster full, 256 GiB of host RAM per node for parked state):
  arrival   the steady state of a deep queue: the waiting jobs (parked to disk, or pending after a
            disk park) rank behind the running ones, which are past their minimum runtime; one urgent
            job has just arrived and takes a victim's GPU.
  free      the same queue with 8 nodes' jobs just finished: 64 free GPUs to fill.
  turnover  the worst case: every running job past its minimum runtime and outranked by thousands
            of waiting jobs, so one decision pauses (nearly) the whole cluster -- hundreds of pauses.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys

from gpuswap import policy
from gpuswap.policy.model import GpuView, JobView, Phase, PolicyConfig, Snapshot

from machine import cpu_model, timed  # bench/machine.py: python puts bench/ first on sys.path

GiB = 1024**3
NOW = 1e6
CONFIG = [PolicyConfig()]    # --class-floor replaces it: the default floor lifts low jobs (policies.md)
DISK = frozenset({"disk"})


def _gpus(nodes: int) -> tuple[GpuView, ...]:
    return tuple(GpuView(i, f"n{i // 8:03d}", 80 * GiB) for i in range(nodes * 8))


def _running(rng: random.Random, nodes: int, skip_nodes: int = 0) -> list[JobView]:
    """Normal-class jobs of 1, 2, 4 and 8 GPUs packed onto each node, past their minimum runtime and
    within their first time slice, little served and (for the oracle) nearly done."""
    jobs = []
    for n in range(skip_nodes, nodes):
        left = 8
        while left:
            g = min(rng.choice([1, 1, 1, 2, 4, 8]), left)
            gpus = tuple(range(n * 8 + 8 - left, n * 8 + 8 - left + g))
            left -= g
            started = NOW - rng.uniform(120, 500)
            jobs.append(JobView(id=f"r{len(jobs)}", user=f"u{rng.randrange(40)}", priority=1,
                                phase=Phase.RUNNING, gpus=g, mem_bytes=rng.randint(1, 60) * GiB,
                                submit_time=started - rng.uniform(0, 1e4), phase_since=started,
                                last_start=started, attained_gpu_s=(NOW - started) * g, run_s=NOW - started,
                                assigned=gpus, width=g, remaining_s=rng.uniform(1e2, 1e3)))
    return jobs


def _served_waiting(rng: random.Random, n: int) -> list[JobView]:
    """Low and normal jobs that have run for hours and were parked to disk (or requeued), waiting
    their turn (for less time than they ran: not starving), with more left to run than the running."""
    jobs = []
    for i in range(n):
        g = rng.choice([1, 1, 1, 2, 4, 8])
        run_s = rng.uniform(4e4, 2e5)
        paused = rng.random() < 0.7
        jobs.append(JobView(id=f"w{i}", user=f"u{rng.randrange(40)}", priority=rng.choice([0, 1, 1]),
                            phase=Phase.PAUSED if paused else Phase.PENDING, gpus=g,
                            mem_bytes=rng.randint(1, 60) * GiB, submit_time=NOW - run_s - rng.uniform(0, 1e5),
                            phase_since=NOW - rng.uniform(0, run_s), last_start=NOW - run_s,
                            attained_gpu_s=run_s * g, run_s=run_s, switch_s=20.0,
                            parked="disk" if paused else None, parked_bytes=0, tiers=DISK if paused else DISK | {"ram"},
                            width=g, remaining_s=rng.uniform(1e3, 1e5)))
    return jobs


def arrival(waiting: int, nodes: int, seed: int = 0) -> Snapshot:
    rng = random.Random(seed)
    urgent = JobView(id="urgent", user="u0", priority=3, phase=Phase.PENDING, gpus=1, mem_bytes=10 * GiB,
                     submit_time=NOW, phase_since=NOW, remaining_s=600.0)
    jobs = _running(rng, nodes) + _served_waiting(rng, waiting - 1) + [urgent]
    return _snapshot(nodes, jobs)


def free(waiting: int, nodes: int, seed: int = 0) -> Snapshot:
    rng = random.Random(seed)
    return _snapshot(nodes, _running(rng, nodes, skip_nodes=8) + _served_waiting(rng, waiting))


def turnover(waiting: int, nodes: int, seed: int = 0) -> Snapshot:
    """One-GPU running jobs, all past their minimum runtime; a queue with many higher classes."""
    rng = random.Random(seed)
    jobs = []
    for i in range(nodes * 8):
        jobs.append(JobView(id=f"r{i}", user=f"u{i % 40}", priority=rng.choice([0, 1, 1, 2]), phase=Phase.RUNNING,
                            gpus=1, mem_bytes=rng.randint(1, 60) * GiB, submit_time=NOW - rng.uniform(1e3, 1e5),
                            phase_since=NOW - rng.uniform(100, 1e4), last_start=NOW - rng.uniform(100, 1e4),
                            attained_gpu_s=rng.uniform(0, 1e5), run_s=5000, assigned=(i,),
                            remaining_s=rng.uniform(1e3, 1e5)))
    for i in range(waiting):
        jobs.append(JobView(id=f"p{i}", user=f"u{i % 40}", priority=rng.choice([0, 1, 1, 2, 3]), phase=Phase.PENDING,
                            gpus=rng.choice([1, 1, 1, 2, 4, 8]), mem_bytes=rng.randint(1, 60) * GiB,
                            submit_time=NOW - rng.uniform(0, 1e5), phase_since=NOW - rng.uniform(0, 1e5),
                            attained_gpu_s=rng.choice([0, 0, rng.uniform(0, 1e5)]), remaining_s=rng.uniform(1e3, 1e5)))
    return _snapshot(nodes, jobs)


def _snapshot(nodes: int, jobs: list[JobView]) -> Snapshot:
    return Snapshot(now=NOW, gpus=_gpus(nodes), jobs=tuple(jobs), config=CONFIG[0],
                    ram_budget={f"n{k:03d}": 256 * GiB for k in range(nodes)},
                    usage={f"u{k}": k * 1e4 for k in range(40)})


SCENARIOS = {"arrival": arrival, "free": free, "turnover": turnover}


def reference_s(snap: Snapshot, repeat: int) -> float:
    waiting = [j for j in snap.jobs if j.phase in (Phase.PENDING, Phase.PAUSED)]
    return statistics.median(timed(lambda: sorted(waiting, key=lambda j: (j.submit_time, j.id)), repeat))




def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default=",".join(policy.POLICIES))
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--waiting", type=int, default=10_000)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--class-floor", type=float, default=PolicyConfig().class_floor_share, metavar="SHARE",
                   help="gpuswap's class floor share (0: none; the decisions of a snapshot change with it)")
    args = p.parse_args()
    CONFIG[0] = PolicyConfig(class_floor_share=args.class_floor)
    rows, refs = [], {}
    for name in args.scenarios.split(","):
        if name not in SCENARIOS:
            print(f"bench_decide: unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
            return 64
        snap = SCENARIOS[name](args.waiting, args.nodes)
        refs[name] = ref = reference_s(snap, args.repeat)
        for pol in args.policies.split(","):
            decisions = policy.decide(snap, pol)
            ts = timed(lambda: policy.decide(snap, pol), args.repeat)
            med = statistics.median(ts)
            rows.append({"scenario": name, "policy": pol, "min_ms": min(ts) * 1e3, "median_ms": med * 1e3,
                         "x_reference": med / ref, "decisions": len(decisions)})

    from rich.console import Console
    from rich.table import Table

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    table = Table(title=(f"one decision, {args.waiting:,} waiting jobs on {args.nodes}x8 GPUs, {args.repeat} runs each, "
                         f"class floor {args.class_floor:g}\n"
                         f"{cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                         f"load average {load:.1f}; reference (sort the queue once): "
                         + ", ".join(f"{n} {r * 1e3:.2f} ms" for n, r in refs.items())))
    for col in ("scenario", "policy", "decisions", "min ms", "median ms", "x reference", "<= 20 ms"):
        table.add_column(col, justify="left" if col in ("scenario", "policy") else "right")
    for r in rows:
        table.add_row(r["scenario"], r["policy"], str(r["decisions"]), f"{r['min_ms']:.1f}", f"{r['median_ms']:.1f}",
                      f"{r['x_reference']:.1f}", "yes" if r["median_ms"] <= 20 else "no")
    Console(width=160).print(table)
    print(json.dumps({"machine": cpu_model(), "cores": os.cpu_count(), "load": load, "class_floor": args.class_floor,
                      "reference_ms": {n: r * 1e3 for n, r in refs.items()}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
