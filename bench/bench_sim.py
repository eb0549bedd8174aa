"""Benchmark the simulator on the full Philly trace: wall time and peak RSS per policy.

    python bench/bench_sim.py [--trace ../shared/data/philly.csv] [--policies las,gpuswap]
                              [--nodes 64] [--gpus-per-node 8] [--switch-cost gpuswap] [--limit N]

Each policy runs in its own child process (so peak RSS is per policy and runs do not share caches).
The reference, measured in the same run, is a pure-Python pass over the trace: parse the CSV and
touch every job once -- the floor any simulator written in Python pays. The table shows each
policy's wall time, its CPU time (what to compare when the machine is shared), its ratio to that
reference and to fifo (when fifo is in the set), and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from machine import cpu_model  # bench/machine.py: python puts bench/ first on sys.path

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "..", "..", "shared", "data", "philly.csv")

CHILD = r"""
import json, resource, sys, time
from gpuswap.sim.engine import Cluster, simulate
from gpuswap.sim.trace import load
trace, policy, nodes, gpn, cost, limit, tick = sys.argv[1:8]
t = load(trace, gpus_per_node=int(gpn), limit=int(limit) if limit != "0" else None)
t0 = time.perf_counter()
cpu0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
r = simulate(t.jobs, policy, cluster=Cluster(int(nodes), int(gpn)), cost_model=cost, tick_s=float(tick))
wall = time.perf_counter() - t0
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "rss_mib": ru.ru_maxrss / 1024, "cpu_s": ru.ru_utime + ru.ru_stime - cpu0,
                  "jobs": len(t.jobs), "calls": r.decide_calls, "events": r.events}))
"""




def reference_s(trace: str, limit: int) -> float:
    from gpuswap.sim.trace import load

    t0 = time.perf_counter()
    t = load(trace, limit=limit or None)
    total = 0.0
    for j in t.jobs:
        total += j.duration * j.gpus
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=os.path.abspath(DEFAULT_TRACE))
    p.add_argument("--policies", default="fifo,priority,las,gandiva,srtf-oracle,gpuswap")
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--switch-cost", default="gpuswap")
    p.add_argument("--tick", type=float, default=300.0)
    p.add_argument("--limit", type=int, default=0, help="first N jobs only (0: all)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per policy, seconds")
    args = p.parse_args()
    if not os.path.exists(args.trace):
        print(f"bench_sim: trace {args.trace} not found", file=sys.stderr)
        return 64
    ref = reference_s(args.trace, args.limit)
    rows = {}
    for policy in args.policies.split(","):
        cmd = [sys.executable, "-c", CHILD, args.trace, policy, str(args.nodes), str(args.gpus_per_node),
               args.switch_cost, str(args.limit), str(args.tick)]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rows[policy] = {"wall_s": None, "note": f"> {args.timeout:.0f} s (timed out)"}
            continue
        if out.returncode != 0:
            rows[policy] = {"wall_s": None, "note": out.stderr.strip().splitlines()[-1:]}
            continue
        rows[policy] = json.loads(out.stdout.strip().splitlines()[-1])
        rows[policy]["process_s"] = time.perf_counter() - t0

    from rich.console import Console
    from rich.table import Table

    fifo = rows.get("fifo", {}).get("wall_s")
    table = Table(title=(f"gpuswap sim on {os.path.basename(args.trace)}: {args.nodes}x{args.gpus_per_node} GPUs, "
                         f"switch cost {args.switch_cost}, tick {args.tick:g} s\n{cpu_model()}, "
                         f"{os.cpu_count()} cores, Python {platform.python_version()}; "
                         f"reference (parse + one pass over the trace) {ref:.2f} s"))
    for col in ("policy", "jobs", "wall s", "CPU s", "x reference", "x fifo", "decide calls", "peak RSS MiB", "note"):
        table.add_column(col, justify="left" if col in ("policy", "note") else "right")
    for policy, r in rows.items():
        w = r.get("wall_s")
        table.add_row(policy, str(r.get("jobs", "-")), f"{w:.1f}" if w else "-",
                      f"{r['cpu_s']:.1f}" if "cpu_s" in r else "-",
                      f"{w / ref:.0f}" if w else "-", f"{w / fifo:.1f}" if w and fifo else "-",
                      f"{r.get('calls', 0):,}", f"{r['rss_mib']:.0f}" if "rss_mib" in r else "-",
                      str(r.get("note", "")))
    Console(width=160).print(table)
    print(json.dumps({"machine": cpu_model(), "cores": os.cpu_count(), "reference_s": ref, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
