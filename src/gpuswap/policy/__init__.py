"""gpuswap's scheduling policy core: a pure function from a Snapshot to a list of decisions.

The daemon and the simulator both call `decide`; nothing here does I/O, reads a clock, draws
random numbers or starts processes. See docs/policies.md for what each policy does and why.
"""
from gpuswap.policy.model import *  # noqa: F401,F403  (the contract: Snapshot, JobView, decisions...)
from gpuswap.policy.model import Decision, Snapshot, Wait
from gpuswap.policy.costs import choose_tier, switch_s  # noqa: F401
from gpuswap.policy.engine import schedule, schedule_explained
from gpuswap.policy.fairshare import decay_usage  # noqa: F401
from gpuswap.policy.policies import SPECS

POLICIES: tuple[str, ...] = ("gpuswap", "fifo", "priority", "las", "gandiva", "srtf-oracle")
DEFAULT_POLICY = "gpuswap"
LIVE_POLICIES: tuple[str, ...] = tuple(p for p in POLICIES if not SPECS[p].sim_only)


def decide(snapshot: Snapshot, policy: str = DEFAULT_POLICY) -> list[Decision]:
    """Decisions for this snapshot under `policy`. Deterministic: the same snapshot gives the same list.

    Raises ValueError for an unknown policy, and for 'srtf-oracle' when a job lacks remaining_s.
    """
    return schedule(snapshot, _spec(policy))


def decide_explained(snapshot: Snapshot, policy: str = DEFAULT_POLICY) -> tuple[list[Decision], dict[str, Wait]]:
    """`decide`'s decisions (the same list), and for each schedulable waiting job it did not start
    or resume, why: the rule of the round that held it, with its numbers (`Wait`, by job id).
    For the daemon; the simulator calls `decide`, which spends nothing on explanations."""
    return schedule_explained(snapshot, _spec(policy))


def _spec(policy: str):
    spec = SPECS.get(policy)
    if spec is None:
        raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    return spec
