"""`gpuswap sim`: run the trace-driven simulator for one policy, several, or all (--compare)."""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from typing import Any, Optional

from gpuswap.exitcodes import EX_FAILURE, EX_SOFTWARE, EX_USAGE
from gpuswap.jobs import parse_size
from gpuswap.policy import DEFAULT_POLICY, POLICIES
from gpuswap.policy.model import PolicyConfig

SIM_EXTRA = ("numpy", "matplotlib")
ESTIMATE_MODES = ("predicted", "none")   # pyproject's `sim` extra: the daemon and the other verbs need neither


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="CSV trace (see docs/simulator.md for columns)")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"policy name or comma list; one of: {', '.join(POLICIES)}")
    p.add_argument("--compare", action="store_true", help="run every policy on the same trace and seed")
    p.add_argument("--nodes", type=int, default=64, metavar="N", help="nodes in the simulated cluster")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs on each node")
    p.add_argument("--ram-per-node", default="256GiB", help="host RAM per node for parked GPU state")
    p.add_argument("--switch-cost", default="gpuswap",
                   help="gpuswap | checkpoint | fixed:SECONDS | measured:FILE (gpuswap gpus --json)")
    p.add_argument("--multi-rank", default="cooperative",
                   help="cooperative: a multi-GPU job is a data-parallel job parked at the multi-rank "
                        "cost (default); none: multi-GPU jobs are not preemptible (gpuswap before issue 13)")
    p.add_argument("--estimates", default="predicted",
                   help="predicted: runtime estimates learnt from the jobs finished so far (default); "
                        "none: no estimates (gpuswap ranks by attained service alone)")
    p.add_argument("--urgent-fraction", type=float, default=0.1,
                   help="share of jobs <= 15 min marked urgent when the trace has no class column")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the trace's random choices (urgent marks); the same seed gives the same run")
    p.add_argument("--limit", type=int, default=None, help="use only the first N jobs (by submit time)")
    p.add_argument("--tick", type=float, default=300.0,
                   help="seconds between re-evaluations while jobs wait (time-based rules)")
    p.add_argument("--min-runtime", type=float, default=PolicyConfig().min_runtime_s, metavar="SECONDS",
                   help="minimum runtime after a start or resume before a job may be preempted")
    p.add_argument("--out", default=None, help="directory for summary.json, CSVs and plots")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sim", help="simulate scheduling policies on a job trace",
                              description=__doc__)
    add_arguments(p)
    p.set_defaults(func=run)


def _usage(msg: str) -> int:
    print(f"gpuswap sim: {msg}", file=sys.stderr)
    return EX_USAGE


def _missing_extra() -> list[str]:
    """The `sim` extra's modules that are not installed. Only absence is told here: a module that
    is there but broken still fails loudly where it is imported."""
    return [name for name in SIM_EXTRA if importlib.util.find_spec(name) is None]


def _bad_option(args: argparse.Namespace) -> Optional[str]:
    """The first option out of range, as a sentence; None when all are usable. (Checked here, not
    only in argparse types: `run` is also called with a Namespace built elsewhere.)"""
    finite = math.isfinite
    if args.nodes < 1 or args.gpus_per_node < 1:
        return "--nodes and --gpus-per-node must be >= 1"
    if not (finite(args.urgent_fraction) and 0.0 <= args.urgent_fraction <= 1.0):
        return "--urgent-fraction must be between 0 and 1"
    if not (finite(args.tick) and args.tick > 0):
        return f"--tick must be a number of seconds > 0, got {args.tick}"
    if not (finite(args.min_runtime) and args.min_runtime >= 0):
        return f"--min-runtime must be a number of seconds >= 0, got {args.min_runtime}"
    if args.limit is not None and args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    if getattr(args, "estimates", "predicted") not in ESTIMATE_MODES:
        return f"unknown --estimates {args.estimates!r}; use {' or '.join(ESTIMATE_MODES)}"
    return None


def run(args: argparse.Namespace) -> int:
    missing = _missing_extra()
    if missing:
        print(f"gpuswap sim: needs {' and '.join(missing)}, not installed here: pip install 'gpuswap[sim]'",
              file=sys.stderr)
        return EX_FAILURE
    # Imported here, not at the top: every `gpuswap` call registers this verb, and the engine's
    # imports (numpy among them) cost each CLI call ~0.1 s of CPU. A broken import still fails loudly.
    from gpuswap.sim.costmodel import parse_cost_model, parse_multi_rank
    from gpuswap.sim.engine import Cluster, SimError, simulate
    from gpuswap.sim.trace import TraceError, describe_skipped, load

    policies = list(POLICIES) if args.compare else [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        return _usage(f"unknown policy {', '.join(unknown) or '(none)'}; choose from {', '.join(POLICIES)}")
    problem = _bad_option(args)
    if problem:
        return _usage(problem)
    try:
        ram = parse_size(args.ram_per_node)
        model = parse_cost_model(args.switch_cost)
        multi_rank = parse_multi_rank(getattr(args, "multi_rank", "cooperative"))
        trace = load(args.trace, seed=args.seed, urgent_fraction=args.urgent_fraction,
                     gpus_per_node=args.gpus_per_node, limit=args.limit)
    except (TraceError, ValueError) as e:
        return _usage(str(e))
    if trace.skipped:
        print(describe_skipped(trace), file=sys.stderr)
    if trace.rounded:
        print(f"{trace.rounded} job(s) asked for a fraction of a GPU; rounded up to whole GPUs", file=sys.stderr)
    cluster = Cluster(args.nodes, args.gpus_per_node, ram)
    estimates = getattr(args, "estimates", "predicted") == "predicted"
    config = PolicyConfig(min_runtime_s=args.min_runtime)
    from gpuswap.sim.metrics import summarize
    from gpuswap.sim.report import print_table, write_outputs

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    summaries, results = {}, {}
    # Progress on stderr, and only on a terminal: a full-trace run takes minutes per policy.
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("jobs finished"), TimeElapsedColumn(), transient=True,
                  disable=not sys.stderr.isatty()) as bar:
        for name in policies:
            task = bar.add_task(f"simulating {name}", total=len(trace.jobs))
            t0 = time.perf_counter()
            try:
                r = simulate(trace.jobs, name, cluster=cluster, cost_model=model, config=config,
                             tick_s=args.tick, multi_rank=multi_rank, estimates=estimates, progress=lambda done, _, t=task: bar.update(t, completed=done))
            except SimError as e:
                print(f"gpuswap sim: internal error under policy {name}: {e}", file=sys.stderr)
                return EX_SOFTWARE
            bar.remove_task(task)
            results[name] = r
            summaries[name] = summarize(r) | {"wall_s": round(time.perf_counter() - t0, 2)}
    gpus = args.nodes * args.gpus_per_node
    title = (f"{len(trace.jobs):,} jobs on {args.nodes}x{args.gpus_per_node} = {gpus} GPUs, "
             f"switch cost {model.name}, multi-rank {'cooperative' if multi_rank else 'none'}, "
             f"estimates {'predicted' if estimates else 'none'}, seed {args.seed}")
    print_table(summaries, title)
    if trace.clamped:
        print(f"{trace.clamped} job(s) wider than a node were narrowed to {args.gpus_per_node} GPUs "
              "(same GPU-time)")
    if args.out:
        meta = {"trace": args.trace, "jobs": len(trace.jobs), "skipped": trace.skipped,
                "skipped_by_reason": trace.skipped_by_reason, "rounded_gpus": trace.rounded,
                "clamped": trace.clamped, "nodes": args.nodes, "gpus_per_node": args.gpus_per_node,
                "ram_per_node": ram, "switch_cost": model.name, "seed": args.seed,
                "urgent_fraction": args.urgent_fraction, "tick_s": args.tick,
                "min_runtime_s": args.min_runtime,
                "multi_rank": "cooperative" if multi_rank else "none",
                "estimates": "predicted" if estimates else "none"}
        for path in write_outputs(args.out, summaries, results, meta):
            print(f"wrote {path}")
    return 0
