"""On simulated GPUs, a job that uses the runtime is a simulated CUDA process, as a real one is.

A real training process holds device memory the runtime never attaches: its CUDA context (module
code, the driver's per-context buffers), library handles and workspaces (cuBLAS, cuDNN, NCCL),
CUDA-graph and torch.compile pools, tensors it did not attach. A cooperative RAM park frees the
attached tensors and the allocator's cache, never that floor: NVML keeps listing the process with
it. Without a GPU the daemon finds a job's device memory only in the simulated device's process
list (gpuswap.simcuda), so the runtime registers its process there with

    attached device bytes + DDP bucket buffers    (CPU tensors stand for device memory in simulation)

and the simulated device adds the process's CUDA context, as any CUDA process holds one
(simcuda.DEFAULT_CONTEXT_BYTES, with its sources; GPUSWAP_SIM_CONTEXT_BYTES for tests): that is
the floor a park cannot free. The registration is updated whenever a measurement changes: at
attach, at each measured safepoint, before a RAM park is reported (nothing attached, so the
context alone, plus the bucket buffers of any DDP Reducer the park keeps) and before a resume is
reported (all of it again). A disk park exits, and the registration dies with the process. DDP's
Reducer holds one flat buffer per bucket, about one more copy of the gradients, in no tensor the
job attached; a real process's NVML figure includes them, so the simulated one does too
(runtime/ddpreducer.py: a multi-rank RAM park frees them unless a reason keeps the Reducer; a
single-process park never does). Not modelled: the caching allocator's cache, activations,
tensors not attached, a communication hook's own result buffers.

The floor is the simulated context (simcuda.DEFAULT_CONTEXT_BYTES): 512 MiB by default, in the
range PyTorch processes show (pytorch/pytorch#86509, #34323; library handles and workspaces
included once cuBLAS/cuDNN/NCCL have initialized).

One registration per process, on its first visible GPU (simcuda's model: one GPU per process; a
rank of a multi-rank job on visible GPU LOCAL_RANK, `bind`), so
a simulated job that spreads tensors over several GPUs shows its floor on the first one only.
A full simulated GPU refuses memory as a real one does (simcuda.allocate, strict about room):
`hold` then raises what the real torch path raises where the same memory would be taken, with
simcuda's message: torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ...", the class
torch.cuda.OutOfMemoryError names) for an allocation, and for the context, which a process's first
CUDA call creates, torch.AcceleratorError ("CUDA error: out of memory"; torch >= 2.8, a plain
RuntimeError before), each chained to simcuda.OutOfMemoryError with the figures. Where that
surfaces: at `attach` and at a safepoint's measurement (where a real job's own `.to("cuda")` or
step would have failed), and at a resume from RAM, which claims the parked bytes before copying
them back (`Job.claim_device`), as parking.restore's refill allocates them: the resume fails, the
job stays parked and says so, and a later resume may retry, as on a real GPU.

Training thread only (as every walk of the attached tensors): no lock is needed.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from gpuswap import simcuda
from gpuswap.protocol.env import SIM_CUDA_DIR
from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES, context_bytes   # noqa: F401 (the floor: simcuda's context)

_registered: Optional[int] = None       # bytes last registered by this process (None: not yet)
_pid: Optional[int] = None              # ... and by which process (a fork is a process of its own)
_device = 0                             # ordinal within CUDA_VISIBLE_DEVICES (a rank's LOCAL_RANK)


def bind(device: int) -> None:
    """Register on visible device `device` instead of the first: a rank of a multi-rank job uses
    cuda:LOCAL_RANK, as torchrun scripts do, so its context floor sits on its own GPU."""
    global _device, _registered
    visible = len(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(","))
    if device != _device and 0 <= device < visible:     # more ranks than GPUs: they share the first
        _device, _registered = device, None


def hold(attached_bytes: int, simulated: bool) -> None:
    """This process now holds `attached_bytes` on its simulated GPU, beside its CUDA context, which
    the simulated device adds (registered on the first call). Nothing happens on real GPUs or
    outside a daemon's simulated GPUs.

    A CUDA call: while the driver holds the process (a job frozen transparently) it blocks until
    the thaw (simcuda.allocate), as a real allocation would. Callers (the training thread) hold no
    lock of the runtime's around it: its reader thread, which answers the daemon, never waits on it."""
    global _registered, _pid
    if not simulated:
        return
    if not os.environ.get(SIM_CUDA_DIR):
        return
    total = max(0, int(attached_bytes))
    if total == _registered and _pid == os.getpid():
        return
    try:
        simcuda.allocate(total, device=_device)
    except simcuda.OutOfMemoryError as exc:            # the GPU is full: what torch would raise here
        raise as_torch_error(exc) from exc
    except (OSError, ValueError, IndexError) as exc:   # a bad CUDA_VISIBLE_DEVICES, a full disk
        print(f"gpuswap: could not register with the simulated GPU: {exc}", file=sys.stderr, flush=True)
        return
    _registered, _pid = total, os.getpid()


def as_torch_error(exc: "simcuda.OutOfMemoryError") -> RuntimeError:
    """The exception torch raises for this failure (module docstring), with simcuda's message;
    a RuntimeError with it where torch is not importable or too old to have the class."""
    try:
        import torch
    except ImportError:
        return RuntimeError(str(exc))
    cls = getattr(torch, "AcceleratorError", RuntimeError) if exc.context_creation else \
        getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return cls(str(exc))
