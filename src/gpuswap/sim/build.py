"""Build synthetic traces for `gpuswap sim`: `python -m gpuswap.sim.build services --out FILE`.

`services` is the workload of issue 15's production trace, made up here so anyone can rerun it: a
few teams run long-lived, latency-sensitive services (class `urgent`) that carry most of the GPU
demand (`--service-share`, default 0.8 of the GPU-time), while many users submit batch jobs (class
`low`, ~3,200 s mean, heavy-tailed) at a steady rate, the whole at `--load` (default 0.7) of the
cluster's GPU-time over `--days`. Services live a day at the median and ~3 days on average
(lognormal, a few for weeks) and come in a monthly wave (arrival rate `1 + sin(2 pi t / 28 d)`),
so for days at a time they want nearly every GPU; that is when strict classes starve the batch
jobs. A few short interactive jobs of the batch users are `urgent` too (`--interactive`, share of
their jobs): the head start a user within budget keeps. Deterministic: the same options and
`--seed` give the same file. Columns: submit_time (s), duration (s), gpus, user, class.
"""
from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from dataclasses import dataclass
from typing import Optional

from gpuswap.exitcodes import EX_USAGE

DAY = 86400.0
WAVE_S = 28 * DAY                # services' arrival wave: a month
WAVE_DEPTH = 1.0
SERVICE_TEAMS = 4
SERVICE_GPUS = ((1, 0.5), (2, 0.3), (4, 0.2))
SERVICE_MEDIAN_S, SERVICE_SIGMA = DAY, 1.5      # lognormal lifetime of a service: mean ~3 days
BATCH_USERS = 20
BATCH_GPUS = ((1, 0.7), (2, 0.15), (4, 0.1), (8, 0.05))
BATCH_MEDIAN_S, BATCH_SIGMA = 1000.0, 1.5     # lognormal: mean ~3,100 s
INTERACTIVE_S = (60.0, 900.0)    # an urgent interactive job: 1 to 15 minutes, one GPU


@dataclass(frozen=True)
class Row:
    submit: float
    duration: float
    gpus: int
    user: str
    cls: str


def _pick(rng: random.Random, table) -> int:
    return rng.choices([v for v, _ in table], [w for _, w in table])[0]


def _mean(table) -> float:
    return sum(v * w for v, w in table) / sum(w for _, w in table)


def services_trace(gpus: int, days: float, load: float = 0.7, service_share: float = 0.8,
                   interactive: float = 0.02, seed: int = 0) -> list[Row]:
    """The rows of a `services` trace for a cluster of `gpus` GPUs (see the module's docstring)."""
    rng = random.Random(seed)
    horizon = days * DAY
    demand = load * gpus * horizon                  # GPU-seconds over the horizon
    rows: list[Row] = []
    mean_service = SERVICE_MEDIAN_S * math.exp(SERVICE_SIGMA ** 2 / 2) * _mean(SERVICE_GPUS)
    rate = service_share * demand / mean_service / horizon          # services per second, on average
    t = 0.0
    while True:                                     # thinning: a Poisson process of rate(t)
        t += rng.expovariate(rate * (1 + WAVE_DEPTH))
        if t >= horizon:
            break
        if rng.random() * (1 + WAVE_DEPTH) > 1 + WAVE_DEPTH * math.sin(2 * math.pi * t / WAVE_S):
            continue
        duration = rng.lognormvariate(math.log(SERVICE_MEDIAN_S), SERVICE_SIGMA)
        rows.append(Row(t, round(duration), _pick(rng, SERVICE_GPUS), f"svc{rng.randrange(SERVICE_TEAMS)}", "urgent"))
    mean_batch = BATCH_MEDIAN_S * math.exp(BATCH_SIGMA ** 2 / 2) * _mean(BATCH_GPUS)
    rate = (1 - service_share) * demand / mean_batch / horizon
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            break
        user = f"user{rng.randrange(BATCH_USERS):02d}"
        if rng.random() < interactive:
            rows.append(Row(t, round(rng.uniform(*INTERACTIVE_S)), 1, user, "urgent"))
            continue
        duration = max(30.0, rng.lognormvariate(math.log(BATCH_MEDIAN_S), BATCH_SIGMA))
        rows.append(Row(t, round(duration), _pick(rng, BATCH_GPUS), user, "low"))
    # Heavy tails make a month's sample stray far from the mean: scale each kind's durations so the
    # shares and the load are what was asked for.
    want = {"svc": service_share * demand, "user": (1 - service_share) * demand}
    for kind, target in want.items():
        got = sum(r.duration * r.gpus for r in rows if r.user.startswith(kind))
        if got > 0:
            k = target / got
            rows = [Row(r.submit, max(30.0, r.duration * k), r.gpus, r.user, r.cls)
                    if r.user.startswith(kind) else r for r in rows]
    rows.sort(key=lambda r: r.submit)
    return rows


def write(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submit_time", "duration", "gpus", "user", "class"])
        for r in rows:
            w.writerow([f"{r.submit:.1f}", int(r.duration), r.gpus, r.user, r.cls])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuswap.sim.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("services", help="long-running urgent services and low batch jobs")
    s.add_argument("--out", required=True, help="CSV file to write")
    s.add_argument("--nodes", type=int, default=8)
    s.add_argument("--gpus-per-node", type=int, default=8)
    s.add_argument("--days", type=float, default=28.0)
    s.add_argument("--load", type=float, default=0.7, help="offered GPU-time / cluster GPU-time")
    s.add_argument("--service-share", type=float, default=0.8, help="services' share of the GPU-time")
    s.add_argument("--interactive", type=float, default=0.02,
                   help="share of the batch users' jobs that are short urgent interactive jobs")
    s.add_argument("--seed", type=int, default=0)
    try:
        a = p.parse_args(argv)
    except SystemExit as e:
        return EX_USAGE if e.code else 0
    checks = [(a.nodes >= 1 and a.gpus_per_node >= 1, "--nodes and --gpus-per-node must be >= 1"),
              (math.isfinite(a.days) and a.days > 0, "--days must be > 0"),
              (math.isfinite(a.load) and 0 < a.load <= 2, "--load must be in (0, 2]"),
              (0 < a.service_share < 1, "--service-share must be between 0 and 1"),
              (0 <= a.interactive < 1, "--interactive must be in [0, 1)")]
    for ok, msg in checks:
        if not ok:
            print(f"gpuswap sim build: {msg}", file=sys.stderr)
            return EX_USAGE
    rows = services_trace(a.nodes * a.gpus_per_node, a.days, a.load, a.service_share, a.interactive, a.seed)
    write(rows, a.out)
    svc = sum(r.duration * r.gpus for r in rows if r.user.startswith("svc"))
    total = sum(r.duration * r.gpus for r in rows)
    print(f"wrote {len(rows)} jobs to {a.out}: services {svc / total:.0%} of {total / 3600:,.0f} GPU-hours, "
          f"offered load {total / (a.nodes * a.gpus_per_node * a.days * DAY):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
