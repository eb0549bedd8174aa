"""Capture and restore every global random number generator a training step may consume.

Exact resume after a disk checkpoint needs the RNG streams to continue where they stopped:
Python's `random`, NumPy's legacy global generator (only if the job imported NumPy, so we never
import it ourselves), torch's CPU generator and, where CUDA is initialized, every CUDA device's.
"""
from __future__ import annotations

import random
import sys
from typing import Any


def capture() -> dict[str, Any]:
    """Snapshot of all global RNG states, picklable (torch states are CPU ByteTensors)."""
    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch_cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Restore a `capture()` snapshot. Returns warnings for parts that could not be restored."""
    warnings: list[str] = []
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np  # the job used NumPy when it was checkpointed, so it will again

        np.random.set_state(state["numpy"])
    if "torch_cpu" in state or "torch_cuda" in state:
        import torch

        if "torch_cpu" in state:
            torch.set_rng_state(state["torch_cpu"])
        cuda_states = state.get("torch_cuda")
        if cuda_states:
            if not torch.cuda.is_available():
                warnings.append("checkpoint has CUDA RNG states but CUDA is not available here")
            elif torch.cuda.device_count() != len(cuda_states):
                warnings.append(
                    f"checkpoint has {len(cuda_states)} CUDA RNG states, this process sees "
                    f"{torch.cuda.device_count()} devices; restoring the common ones"
                )
                for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(s, i)
            else:
                torch.cuda.set_rng_state_all(cuda_states)
    return warnings
