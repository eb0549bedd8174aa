"""Benchmark the head's decision in a pool (docs/ray.md): 4 nodes x 8 GPUs, 1,000 queued jobs.

    python bench/bench_pool.py [--nodes 4] [--gpus-per-node 8] [--waiting 1000] [--repeat 7]

The goal (issue 16) is one decision in at most 50 ms. What is timed is the head's part of a tick
that a pool adds to the policy's, from the jobs' records to decisions that name (node, GPU): the
pool's layout from each node's GPU list (node/pool.py's Layout), every schedulable job's view with
its GPUs in pool ids (node/snapshot.py's job_view, uncached: the worst tick, after a node joined
or left) and the nodes its working directory allows (node/workdirs.py: the answers known, read;
the checks are made off the tick), the snapshot with each node's own switch costs, `policy.decide`, and each decision's GPUs mapped back to their node. When due
(node/controller.py: EXPLAIN_SHARE times as long after the last as that took, at most EXPLAIN_S)
a tick also works out why each queued job waits (`policy.decide_explained`, with each reason's
GPUs named node:index as people see them): timed as its own row, "+ reasons", the whole of such a
tick; the goal is the decision's. Store I/O and the Ray calls to the nodes are not in it (the nodes are asked
for facts before the decision and told the outcome after). The same records on one machine (a
single daemon's path: no layout, the machine's own GPU indices) are timed beside it, and
`policy.decide` alone on the same snapshot (no explanations: what the simulator calls).

The table gives the fastest and the median, and the ratio of the median to a reference measured in
the same run: sorting the queued jobs once by (submit time, id). Times are the process's CPU time.
Compare ratios, not milliseconds, between machines.

Scenarios (every GPU of the pool full but in `free`):
  arrival   a deep queue (parked to disk on their nodes, or pending) behind running jobs past their
            minimum runtime; one urgent job has just arrived and takes a victim's GPU.
  free      the same queue with one node's jobs just finished: its 8 GPUs to fill.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

from gpuswap import policy
from gpuswap.jobs import JobState
from gpuswap.node import snapshot, workdirs
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.pool import Layout
from gpuswap.node.records import JobRecord
from gpuswap.node.workdirs import WorkdirChecks
from gpuswap.policy.model import PolicyConfig, Snapshot, SwitchCosts

from machine import machine, timed  # bench/machine.py: python puts bench/ first on sys.path

GiB = 1024**3
NOW = 1e6
GOAL_MS = 50.0


def record(i: int, rng: random.Random, state: JobState, gpus: int, node: str | None, assigned: list[int],
           **kw: object) -> JobRecord:
    run_s = float(kw.pop("run_s", 0.0))        # type: ignore[arg-type]
    since = float(kw.pop("since", NOW - rng.uniform(0, 1e4)))   # type: ignore[arg-type]
    base = dict(id=i, name=f"job{i}", user=f"u{rng.randrange(40)}", uid=1000, gid=1000, argv=["true"], cwd="/",
                priority=1, gpus=gpus, mem_bytes=rng.randint(1, 60) * GiB, preemptible=True, state=state,
                reason="", exit_code=None, signal=None, submit_time=since - rng.uniform(0, 1e5), state_since=since,
                last_start=since if state == JobState.RUNNING else None, end_time=None,
                attained_gpu_s=run_s * gpus, run_s=run_s, switch_s=0.0, assigned=assigned, home_gpus=[],
                parked=None, parked_bytes=0, device_bytes=0, generation=1, desired="run", desired_tier=None,
                pause_requested_at=None, hold=False, no_runtime=False, stopped=False, cancel_requested=False,
                preemptions=0, step=None, pause_mode="cooperative", mechanism=None, attached=True,
                transparent_refused=None, abort_reason=None, ram_allowance=None, residue={}, ranks=[], version=i,
                width=gpus, estimate_s=rng.uniform(1e3, 1e5), node=node)
    base.update(kw)
    return JobRecord(**base)   # type: ignore[arg-type]


def node_name(n: int) -> str:
    return f"node-{n:02d}"


def jobs_for(scenario: str, nodes: int, per_node: int, waiting: int, seed: int = 0) -> list[JobRecord]:
    """The records: running jobs of 1, 2, 4 or 8 GPUs packed onto each node (all but the first in
    `free`), the queue (70% parked to disk on a node, the rest pending), and in `arrival` one urgent."""
    rng = random.Random(seed)
    out: list[JobRecord] = []
    for n in range(1 if scenario == "free" else 0, nodes):
        left = per_node
        while left:
            g = min(rng.choice([1, 1, 1, 2, 4, 8]), left)
            at = per_node - left
            left -= g
            started = NOW - rng.uniform(120, 500)
            out.append(record(len(out) + 1, rng, JobState.RUNNING, g, node_name(n), list(range(at, at + g)),
                              since=started, run_s=NOW - started))
    for _ in range(waiting - (scenario == "arrival")):
        g = rng.choice([1, 1, 1, 2, 4, 8])
        run_s = rng.uniform(4e4, 2e5)
        if rng.random() < 0.7:
            out.append(record(len(out) + 1, rng, JobState.PAUSED, g, node_name(rng.randrange(nodes)), [],
                              run_s=run_s, switch_s=20.0, parked="disk", priority=rng.choice([0, 1, 1]),
                              since=NOW - rng.uniform(0, run_s), preemptions=1))
        else:
            out.append(record(len(out) + 1, rng, JobState.PENDING, g, None, [], priority=rng.choice([0, 1, 1]),
                              since=NOW - rng.uniform(0, 1e5)))
    if scenario == "arrival":
        out.append(record(len(out) + 1, rng, JobState.PENDING, 1, None, [], priority=3, since=NOW))
    return out


def on_one_machine(jobs: list[JobRecord], per_node: int) -> list[JobRecord]:
    """The same jobs on one machine of nodes x per_node GPUs: no node, the machine's GPU indices."""
    from dataclasses import replace
    base = {node_name(n): n * per_node for n in range(100)}
    return [replace(j, node=None, assigned=[base[j.node] + g for g in j.assigned] if j.node else j.assigned)
            for j in jobs]


def gpu_lists(nodes: int, per_node: int) -> dict[str, list[GpuInfo]]:
    return {node_name(n): [GpuInfo(i, "simulated 80GiB", f"sim-{n}-{i}", 80 * GiB, None, True)
                           for i in range(per_node)] for n in range(nodes)}


def warm_workdirs(by_node: dict[str, list[GpuInfo]], jobs: list[JobRecord]) -> WorkdirChecks:
    """The pool's working-directory answers (node/workdirs.py) for every job, all known: what a
    tick reads (the checks themselves are made off the tick, on their own threads)."""
    checks = WorkdirChecks(lambda node, cwd, uid, gid: None)
    while any(len(checks.answers(by_node, j.cwd, j.uid, j.gid)) < len(by_node) for j in jobs):
        pass
    return checks


def pool_snapshot(by_node: dict[str, list[GpuInfo]], jobs: list[JobRecord], single: bool,
                  layout: Layout | None, checks: WorkdirChecks | None = None) -> Snapshot:
    """As the controller builds it; in a pool with each waiting job's nodes by its working
    directory (`checks`) and each node's own switch costs."""
    def allowed(j: JobRecord) -> tuple[str, ...]:
        answers = None if single or checks is None else checks.answers(by_node, j.cwd, j.uid, j.gid)
        return workdirs.reach(j, answers, by_node).nodes

    views = [snapshot.job_view(j, False, False, layout, allowed_nodes=allowed(j)) for j in jobs
             if snapshot.schedulable(j)]
    node_costs = None if single else {n: SwitchCosts(disk_write_bps=(1 + i) * 1e9) for i, n in enumerate(by_node)}
    return snapshot.build(NOW, snapshot.pool_gpus(by_node, single), views, PolicyConfig(), SwitchCosts(),
                          256 * GiB, {f"u{k}": k * 1e4 for k in range(40)}, node_costs=node_costs)


def head_decision(by_node: dict[str, list[GpuInfo]], jobs: list[JobRecord], single: bool, explained: bool,
                  checks: WorkdirChecks | None = None) -> int:
    """The head's part of one tick, records to decisions naming their node (see the docstring);
    `explained`: a tick that also works out why each waiting job waits (when due)."""
    layout = None if single else Layout.of(by_node)
    snap = pool_snapshot(by_node, jobs, single, layout, checks)
    if explained:
        decisions, waits = policy.decide_explained(snap, "gpuswap")
    else:
        decisions, waits = policy.decide(snap, "gpuswap"), {}
    if layout is not None:
        _ = {k: layout.name_gpus(w.text) for k, w in waits.items()}
        for d in decisions:
            _ = [layout.to_node(g) for g in getattr(d, "gpus", ())]
    return len(decisions)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--waiting", type=int, default=1000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    if args.nodes < 1 or args.gpus_per_node < 1 or args.waiting < 1 or args.repeat < 1:
        print("bench_pool: --nodes, --gpus-per-node, --waiting and --repeat must be at least 1", file=sys.stderr)
        return 64
    rows, refs = [], {}
    for scenario in ("arrival", "free"):
        pooled = jobs_for(scenario, args.nodes, args.gpus_per_node, args.waiting)
        queued = [j for j in pooled if j.state in (JobState.PENDING, JobState.PAUSED)]
        refs[scenario] = ref = statistics.median(
            timed(lambda: sorted(queued, key=lambda j: (j.submit_time, j.id)), args.repeat))
        lists = gpu_lists(args.nodes, args.gpus_per_node)
        one = {"local": [g for gs in lists.values() for g in gs]}
        one["local"] = [GpuInfo(i, g.name, g.uuid, g.mem_total, None, True) for i, g in enumerate(one["local"])]
        for mode, by_node, jobs, single in (("pool", lists, pooled, False),
                                            ("one machine", one, on_one_machine(pooled, args.gpus_per_node), True)):
            checks = None if single else warm_workdirs(by_node, jobs)
            snap = pool_snapshot(by_node, jobs, single, None if single else Layout.of(by_node), checks)
            for part, fn in (("policy.decide", lambda: len(policy.decide(snap, "gpuswap"))),
                             ("head's decision", lambda: head_decision(by_node, jobs, single, False, checks)),
                             ("+ reasons (when due)", lambda: head_decision(by_node, jobs, single, True, checks))):
                n = fn()
                ts = timed(fn, args.repeat)
                med = statistics.median(ts)
                rows.append({"scenario": scenario, "mode": mode, "part": part, "decisions": n,
                             "min_ms": min(ts) * 1e3, "median_ms": med * 1e3, "x_reference": med / ref})

    from rich.console import Console
    from rich.table import Table

    load = os.getloadavg()[0]
    table = Table(title=(f"the head's decision, {args.waiting:,} queued jobs on {args.nodes}x{args.gpus_per_node} GPUs, "
                         f"{args.repeat} runs each\n{machine()}, load average {load:.1f}; reference (sort the queue "
                         "once): " + ", ".join(f"{s} {r * 1e3:.2f} ms" for s, r in refs.items())))
    for col in ("scenario", "mode", "part", "decisions", "min ms", "median ms", "x reference", f"<= {GOAL_MS:.0f} ms"):
        table.add_column(col, justify="left" if col in ("scenario", "mode", "part") else "right")
    for r in rows:
        goal = "" if r["part"].startswith("+") else "yes" if r["median_ms"] <= GOAL_MS else "no"
        table.add_row(r["scenario"], r["mode"], r["part"], str(r["decisions"]), f"{r['min_ms']:.1f}", f"{r['median_ms']:.1f}",
                      f"{r['x_reference']:.1f}", goal)
    Console(width=160).print(table)
    print(json.dumps({"machine": machine(), "load": load, "reference_ms": {s: r * 1e3 for s, r in refs.items()},
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
