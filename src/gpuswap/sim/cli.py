"""`gpuswap sim`: run the trace-driven simulator for one policy, several, or all (--compare)."""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from typing import Any, Optional

from gpuswap.exitcodes import EX_FAILURE, EX_SOFTWARE, EX_USAGE
from gpuswap.jobs import parse_size
from gpuswap.policy import DEFAULT_POLICY, POLICIES
from gpuswap.policy.model import PolicyConfig

MAX_SIM_GPUS = 1_000_000   # the whole of Philly was 2,490 GPUs

SIM_EXTRA = ("numpy", "matplotlib")
ESTIMATE_MODES = ("predicted", "none")   # pyproject's `sim` extra: the daemon and the other verbs need neither


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="CSV trace (see docs/simulator.md for columns)")
    p.add_argument("--policy", default=DEFAULT_POLICY, action=_Given,
                   help=f"policy name or comma list; one of: {', '.join(POLICIES)}")
    p.add_argument("--compare", action="store_true", help="run every policy on the same trace and seed (instead of --policy)")
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
                   help="no job is preempted within this long after a start or resume (the floor of "
                        "its protection; docs/policies.md)")
    p.add_argument("--protect-multiple", type=float, default=PolicyConfig().protect_multiple, metavar="FACTOR",
                   help="protect a job after a start or resume for this many times its park + resume "
                        "cost, between --min-runtime and --protect-cap (0: --min-runtime for every job)")
    p.add_argument("--protect-cap", type=float, default=PolicyConfig().protect_cap_s, metavar="SECONDS",
                   help="the longest protection after a start or resume (a higher --min-runtime wins)")
    p.add_argument("--reserve-after", type=_seconds_or_never, default=PolicyConfig().reserve_after_s,
                   metavar="SECONDS|never",
                   help="a job that waited this long gets a reservation on the node that can free its "
                        "GPUs soonest (gpuswap policy; docs/policies.md); never: no reservations")
    defaults = PolicyConfig()
    p.add_argument("--class-budget", type=_gpu_hours, default=defaults.class_budget_gpu_h, metavar="GPU_HOURS",
                   action=_Given,
                   help="gpuswap: a user's decayed urgent (or high) GPU-hours beyond which their jobs of that "
                        "class are treated one class down; 'inf' for no budget (docs/policies.md)")
    p.add_argument("--class-half-life", type=float, default=defaults.class_half_life_s, metavar="SECONDS",
                   help="gpuswap: half-life of the usage the class budget counts")
    p.add_argument("--class-floor", type=float, default=defaults.class_floor_share, metavar="SHARE", action=_Given,
                   help="gpuswap: share of the GPUs each class below the highest is guaranteed; 0 for none")
    p.add_argument("--promotion-takes-starved", action="store_true",
                   help="gpuswap: the old promotion rule: a job promoted for starving may pause a job that "
                        "has itself waited as long (by default it does not; docs/policies.md)")
    p.add_argument("--strict-classes", action="store_true",
                   help="gpuswap: no class budget and no floor (same as --class-budget inf --class-floor 0; "
                        "not with either)")
    p.add_argument("--out", default=None, help="directory for summary.json, CSVs and plots")


class _Given(argparse.Action):
    """Store the value, and note in `given` that the option was on the command line: for options
    another one overrides (`--compare` every policy, `--strict-classes` the class limits), where a
    value given and then silently dropped must be refused instead (`_bad_option`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = getattr(namespace, "given", frozenset()) | {self.dest}


def _seconds_or_never(text: str) -> Optional[float]:
    """A number of seconds, or "never" (None). Range is checked in `_bad_option`."""
    if text.strip().lower() == "never":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds or 'never', got {text!r}") from None


def _gpu_hours(text: str) -> float:
    """A budget in GPU-hours, or inf / none / off for no budget (argparse type: a bad one exits 64)."""
    if text.strip().lower() in ("inf", "none", "off"):
        return math.inf
    return float(text)


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
    given = getattr(args, "given", frozenset())
    if args.compare and "policy" in given:
        return "--compare runs every policy; give --compare or --policy, not both"
    if getattr(args, "strict_classes", False) and given & {"class_budget", "class_floor"}:
        return ("--strict-classes is --class-budget inf --class-floor 0; give it or those options, "
                "not both")
    if args.seed < 0:
        return f"--seed must be a whole number >= 0, got {args.seed}"
    if args.nodes < 1 or args.gpus_per_node < 1:
        return "--nodes and --gpus-per-node must be >= 1"
    if args.nodes * args.gpus_per_node > MAX_SIM_GPUS:    # each simulated GPU is an object: memory
        return f"--nodes x --gpus-per-node must be at most {MAX_SIM_GPUS:,} GPUs"
    if not (finite(args.urgent_fraction) and 0.0 <= args.urgent_fraction <= 1.0):
        return "--urgent-fraction must be between 0 and 1"
    if not (finite(args.tick) and args.tick > 0):
        return f"--tick must be a number of seconds > 0, got {args.tick}"
    if not (finite(args.min_runtime) and args.min_runtime >= 0):
        return f"--min-runtime must be a number of seconds >= 0, got {args.min_runtime}"
    multiple = getattr(args, "protect_multiple", PolicyConfig().protect_multiple)
    if not (finite(multiple) and multiple >= 0):
        return f"--protect-multiple must be a number >= 0, got {multiple}"
    cap = getattr(args, "protect_cap", PolicyConfig().protect_cap_s)
    if not (finite(cap) and cap >= 0):
        return f"--protect-cap must be a number of seconds >= 0, got {cap}"
    reserve = getattr(args, "reserve_after", PolicyConfig().reserve_after_s)
    if reserve is not None and not (finite(reserve) and reserve >= 0):
        return f"--reserve-after must be a number of seconds >= 0 or 'never', got {reserve}"
    if args.limit is not None and args.limit < 1:
        return f"--limit must be >= 1, got {args.limit}"
    budget = getattr(args, "class_budget", PolicyConfig().class_budget_gpu_h)
    if math.isnan(budget) or budget < 0:
        return f"--class-budget must be a number of GPU-hours >= 0 or 'inf', got {budget}"
    half_life = getattr(args, "class_half_life", PolicyConfig().class_half_life_s)
    if not (finite(half_life) and half_life > 0):
        return f"--class-half-life must be a number of seconds > 0, got {half_life}"
    floor = getattr(args, "class_floor", PolicyConfig().class_floor_share)
    if not (finite(floor) and 0 <= floor < 1):
        return f"--class-floor must be a share between 0 and 1 (below 1), got {floor}"
    if getattr(args, "estimates", "predicted") not in ESTIMATE_MODES:
        return f"unknown --estimates {args.estimates!r}; use {' or '.join(ESTIMATE_MODES)}"
    if getattr(args, "out", None) == "":
        return "--out must name a directory, not an empty string"
    return None


def _make_out(out: str) -> Optional[str]:
    """Make the --out directory (and its parents) before simulating, not after: a run of minutes
    must not end in an error about where its results go. What is wrong, or None."""
    try:
        os.makedirs(out, exist_ok=True)
    except FileExistsError:
        return f"--out {out!r} is not a directory"
    except OSError as e:
        return f"--out {out!r}: cannot make the directory: {e.strerror or e}"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out!r}: the directory is not writable by this user"
    return None


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    """The PolicyConfig the options ask for (after `_bad_option`)."""
    d = PolicyConfig()
    strict = getattr(args, "strict_classes", False)
    return PolicyConfig(min_runtime_s=args.min_runtime,
                        protect_multiple=getattr(args, "protect_multiple", d.protect_multiple),
                        protect_cap_s=getattr(args, "protect_cap", d.protect_cap_s),
                        reserve_after_s=getattr(args, "reserve_after", d.reserve_after_s),
                        class_budget_gpu_h=math.inf if strict else getattr(args, "class_budget", d.class_budget_gpu_h),
                        class_half_life_s=getattr(args, "class_half_life", d.class_half_life_s),
                        class_floor_share=0.0 if strict else getattr(args, "class_floor", d.class_floor_share),
                        promotion_spares_starved=not getattr(args, "promotion_takes_starved", False))


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
    except UnicodeDecodeError as e:         # the trace is the only file read here
        return _usage(f"trace {args.trace!r} is not UTF-8 text ({e.reason} at byte {e.start})")
    except (TraceError, ValueError) as e:
        return _usage(str(e))
    problem = _make_out(args.out) if args.out else None
    if problem:
        return _usage(problem)
    if trace.skipped:
        print(describe_skipped(trace), file=sys.stderr)
    if trace.rounded:
        print(f"{trace.rounded} job(s) asked for a fraction of a GPU; rounded up to whole GPUs", file=sys.stderr)
    cluster = Cluster(args.nodes, args.gpus_per_node, ram)
    estimates = getattr(args, "estimates", "predicted") == "predicted"
    config = policy_config(args)
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
                "min_runtime_s": config.min_runtime_s, "protect_multiple": config.protect_multiple,
                "protect_cap_s": config.protect_cap_s, "reserve_after_s": config.reserve_after_s,
                "class_budget_gpu_h": config.class_budget_gpu_h if math.isfinite(config.class_budget_gpu_h) else "inf",
                "class_half_life_s": config.class_half_life_s, "class_floor_share": config.class_floor_share,
                "promotion_spares_starved": config.promotion_spares_starved,
                "multi_rank": "cooperative" if multi_rank else "none",
                "estimates": "predicted" if estimates else "none"}
        try:
            written = write_outputs(args.out, summaries, results, meta)
        except OSError as e:    # the directory was fine before the run: a full disk, or it was removed
            print(f"gpuswap sim: cannot write the results to {args.out}: {e.strerror or e}", file=sys.stderr)
            return EX_FAILURE
        for path in written:
            print(f"wrote {path}")
    return 0
