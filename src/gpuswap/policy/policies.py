"""The policies by name, and the context the engine builds for one (`make_ctx`): the one place
that knows them all, so the rules of each (`specs.py`, `gpuswap.py`) need not know each other.
"""
from __future__ import annotations

from gpuswap.policy import classes
from gpuswap.policy.gpuswap import GPUSWAP, _gs_orders
from gpuswap.policy.model import Snapshot
from gpuswap.policy.specs import FIFO, GANDIVA, LAS, PRIORITY, SRTF_ORACLE, Ctx, Spec

SPECS: dict[str, Spec] = {
    "fifo": FIFO, "priority": PRIORITY, "las": LAS, "gandiva": GANDIVA, "srtf-oracle": SRTF_ORACLE,
    "gpuswap": GPUSWAP,
}


def make_ctx(snap: Snapshot, spec: Spec) -> Ctx:
    """The rules' view of `snap`; for a policy with class limits, what they make of it."""
    ctx = Ctx(snap.now, snap.config, snap.costs, snap.usage)
    if not spec.class_limits:
        return ctx
    # Class limits are gpuswap's: its order ranks the jobs they choose among. The keys it works out
    # (at each job's own class: no limits yet) are kept for the round's queue (`Ctx.known`): with a
    # class under its floor they are a third of a deep queue's.
    known: dict[str, tuple] = {}

    def keys(jobs):
        out = _gs_orders(jobs, ctx)
        known.update(zip([j.id for j in jobs], out))
        return out

    lim = classes.limits(snap, keys)
    if lim is classes.NONE:
        return ctx
    return Ctx(snap.now, snap.config, snap.costs, snap.usage, lim, known)
