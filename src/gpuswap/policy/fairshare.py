"""Fair-share usage: decayed GPU-seconds per user, the same arithmetic in the daemon and the simulator.

Usage decays with a half-life (as Slurm's PriorityDecayHalfLife and KAI's fair share do) so that a
user's heavy use last month weighs less than heavy use this afternoon.
"""
from __future__ import annotations

import math
from typing import Hashable, Mapping, TypeVar

K = TypeVar("K", bound=Hashable)   # a user, or (user, class) for the class budgets (policy/classes.py)

_FORGET_BELOW = 1e-6   # GPU-seconds; users below this are dropped so the mapping stays small


def decay_usage(usage: Mapping[K, float], dt_s: float, gpu_s_by_user: Mapping[K, float],
                half_life_s: float) -> dict[K, float]:
    """Age `usage` by `dt_s` seconds and add the GPU-seconds each user received during that interval.

    The new service is decayed as if received at a constant rate over the interval (the exact
    integral), so splitting an interval into many calls gives the same usage. Pure: returns a new dict.
    """
    if dt_s < 0:
        raise ValueError(f"time went backwards: dt_s={dt_s}")
    factor = mid = 1.0
    if half_life_s > 0 and dt_s > 0:
        rate = math.log(2) / half_life_s
        factor = math.exp(-rate * dt_s)
        mid = -math.expm1(-rate * dt_s) / (rate * dt_s)
    out: dict[K, float] = {}
    for user in set(usage) | set(gpu_s_by_user):
        value = usage.get(user, 0.0) * factor + gpu_s_by_user.get(user, 0.0) * mid
        if value >= _FORGET_BELOW:
            out[user] = value
    return out


def share_key(usage: Mapping[str, float], user: str, weight: float) -> float:
    """Lower is more deserving: the user's decayed usage divided by their weight."""
    return usage.get(user, 0.0) / max(weight, 1e-9)
