"""Helpers for the torchrun workers of tests/multirank (imported from the worker scripts' own
directory): a store barrier, and a rank's state in a form comparable across runs."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def all_arrived(store: Any, key: str, world_size: int) -> None:
    """Return once every rank has reached this point. The store stands in for the supervisor's
    agreement (every rank at the common step) and is not a collective of the group. The last rank
    to arrive sets the fact the others wait on; the store's own timeout is the deadline."""
    if int(store.add(key, 1)) == world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"])


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers as whole tensors (FSDP2's DTensors gathered: a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def local(obj: Any) -> Any:
    """The object with every DTensor replaced by this rank's shard: comparable without a group."""
    if hasattr(obj, "to_local"):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local(v) for v in obj)
    return obj
