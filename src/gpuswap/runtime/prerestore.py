"""The saved state a framework callback restores through the framework's own resume path, before
`attach` runs: Lightning's checkpoint dict (in `setup`), the Hugging Face Trainer's checkpoint
files (in `on_init_end`). Both come from whichever checkpoint `attach` will restore a moment later,
single-rank or multi-rank, so the framework's loops and the attached objects agree.

A multi-rank job's checkpoint is one part per rank plus a manifest (ckparts.py); the framework
state is an attached "stateful" object, which every rank keeps in its own part (rankstate.py).
Some frameworks save part of it on rank 0 only: the Trainer writes weights, optimizer and
scheduler files from the main process and only `rng_state_{rank}.pth` from the others. So the
caller gets this rank's saved state and rank 0's, and merges what it needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from gpuswap.runtime import attaching, checkpoint, pausing, rankstate, ranks

if TYPE_CHECKING:
    from gpuswap.runtime.config import RuntimeConfig


@dataclass(frozen=True)
class SavedState:
    """One attached object's saved state: this rank's, and rank 0's (the same on a single-rank
    job, and on rank 0). `own` is None when the checkpoint does not hold the object (the caller
    says so and lets the framework start afresh); `rank0` when rank 0's part does not."""

    own: Any
    rank0: Any
    step: int
    rank: int
    world_size: int


def saved_state(config: "RuntimeConfig", name: str) -> Optional[SavedState]:
    """The state saved for attached object `name` in the checkpoint this job will resume from;
    None when there is no checkpoint, or when it is not the next attach's to restore: another
    attach of the process wrote it (checkpoint.other_attach; that attach says so), so the
    framework starts this phase afresh, as `attach` does. Checkpoints that exist but none
    usable end the process (`restore_failed`, exit 1), as `attach` would: never a silent restart.
    The rank comes from the launcher's environment or the initialized default process group
    (runtime/ranks.py), as at `attach`."""
    who = ranks.identity(group=ranks.default_group())
    if who.world_size == 1:
        _, payload = pausing.choose_or_exit(config)
        if payload is None or checkpoint.attach_of(payload) != attaching.next_attach():
            return None
        state = (payload["objects"].get(name) or {}).get("state")
        return SavedState(state, state, int(payload["step"]), 0, 1)
    chosen, _ = rankstate.choose_or_exit(config.ckpt_dir, config.control, who.rank, who.world_size,
                                         config.job_id)
    if chosen is None or checkpoint.attach_of(chosen.own) != attaching.next_attach():
        return None
    own = ((chosen.own.get("own") or {}).get(name) or {}).get("state")
    first = ((chosen.shared.get("own") or {}).get(name) or {}).get("state")
    return SavedState(own, first, int(chosen.own["step"]), who.rank, who.world_size)


__all__ = ["SavedState", "saved_state"]
