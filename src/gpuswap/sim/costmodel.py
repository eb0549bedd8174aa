"""Switch-cost models for the simulator, expressed in the daemon's own `SwitchCosts` terms.

  gpuswap      park to host RAM at the default measured-order bandwidths (20 GB/s each way, 0.5 s
               fixed per park/resume), disk (1 GB/s write, 2 GB/s read, 10 s restart) when the
               node's RAM budget is full.
  checkpoint   checkpoint-restart only, ~60 s per preemption regardless of size (Tiresias' measured
               order of magnitude): 30 s to save, 30 s to restart.
  fixed:S      checkpoint-restart at S seconds per preemption (S/2 save, S/2 restart).
  measured:F   as `gpuswap`, with the bandwidths a daemon measured on a real machine: F is the
               output of `gpuswap gpus --json` (its "bandwidths"), or a JSON object of
               SwitchCosts fields (ram_park_bps, ram_resume_bps, disk_write_bps, disk_read_bps,
               ram_fixed_s, disk_fixed_s, and for multi-rank jobs group_teardown_s,
               group_rebuild_s, host_copy_bps); fields it lacks keep the defaults.

A job wider than one GPU is a data-parallel job of one rank per GPU; what it can be parked to and
what a park costs come from policy/capability.py, as in the daemon. `--multi-rank none` models
gpuswap before multi-rank support: such jobs are not preemptible at all.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from gpuswap.policy.model import SwitchCosts


@dataclass(frozen=True)
class CostModel:
    name: str
    costs: SwitchCosts
    tiers: frozenset[str]


MULTI_RANK_MODES = ("cooperative", "none")


def parse_multi_rank(text: str) -> bool:
    """`--multi-rank`: True when multi-GPU jobs park cooperatively (the default), False for none."""
    mode = text.strip().lower()
    if mode not in MULTI_RANK_MODES:
        raise ValueError(f"unknown --multi-rank {text!r}; use {' or '.join(MULTI_RANK_MODES)}")
    return mode == "cooperative"


def _measured(path: str) -> CostModel:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"switch-cost measured:{path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"switch-cost measured:{path}: expected a JSON object")
    figures = data.get("bandwidths", data)
    fields = {f.name for f in dataclasses.fields(SwitchCosts)}
    values = {}
    for name, v in figures.items():
        if name not in fields:
            continue
        v = v.get("bytes_per_s", v.get("seconds")) if isinstance(v, dict) else v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"switch-cost measured:{path}: {name} must be a positive number, got {v!r}")
        values[name] = float(v)
    if not values:
        raise ValueError(f"switch-cost measured:{path}: no SwitchCosts figures in it "
                         f"(expected 'bandwidths' from `gpuswap gpus --json`, or {sorted(fields)})")
    return CostModel(f"measured ({os.path.basename(path)})", SwitchCosts(**values), frozenset({"ram", "disk"}))


def parse_cost_model(text: str) -> CostModel:
    if text.strip().lower().startswith("measured:"):
        return _measured(text.strip()[len("measured:"):])
    text = text.strip().lower()
    if text == "gpuswap":
        return CostModel("gpuswap", SwitchCosts(), frozenset({"ram", "disk"}))
    if text == "checkpoint":
        text = "fixed:60"
    if text.startswith("fixed:"):
        try:
            seconds = float(text.split(":", 1)[1])
        except ValueError:
            seconds = -1.0
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"bad switch-cost {text!r}; write fixed:SECONDS, e.g. fixed:60")
        half = seconds / 2
        inf = float("inf")
        # S per preemption whatever the job: a multi-rank job's group rebuild is in its restart.
        costs = SwitchCosts(ram_park_bps=inf, ram_resume_bps=inf, disk_write_bps=inf,
                            disk_read_bps=inf, ram_fixed_s=half, disk_fixed_s=half,
                            group_teardown_s=0.0, group_rebuild_s=0.0, host_copy_bps=inf)
        return CostModel(f"checkpoint {seconds:g}s", costs, frozenset({"disk"}))
    raise ValueError(f"unknown switch-cost model {text!r}; use gpuswap, checkpoint, fixed:SECONDS "
                     "or measured:FILE")
