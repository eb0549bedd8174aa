"""On simulated GPUs, a job that uses the runtime is a simulated CUDA process, as a real one is.

A real training process holds device memory the runtime never attaches: its CUDA context (module
code, the driver's per-context buffers), library handles and workspaces (cuBLAS, cuDNN, NCCL),
CUDA-graph and torch.compile pools, tensors it did not attach. A cooperative RAM park frees the
attached tensors and the allocator's cache, never that floor: NVML keeps listing the process with
it. Without a GPU the daemon finds a job's device memory only in the simulated device's process
list (gpuswap.simcuda), so the runtime registers its process there with

    context floor + attached device bytes + DDP bucket buffers
                                             (CPU tensors stand for device memory in simulation)

updated whenever a measurement changes: at attach, at each measured safepoint, before a RAM park
is reported (the floor, which a park cannot free, plus the bucket buffers of any DDP Reducer the
park keeps) and before a resume is reported (all of it again). A disk park exits, and the
registration dies with the process. DDP's Reducer holds one flat buffer per bucket, about one
more copy of the gradients, in no tensor the job attached; a real process's NVML figure includes
them, so the simulated one does too (runtime/ddpreducer.py: a multi-rank RAM park frees them
unless a reason keeps the Reducer; a single-process park never does). Not modelled: the caching
allocator's cache, activations, tensors not attached, a communication hook's own result buffers.

The floor: PyTorch measured its own context at 287,047,680 bytes with lazy module loading and
666,632,192 bytes without (pytorch/pytorch#86509, which made CUDA_MODULE_LOADING=LAZY torch's
default; NVIDIA's CUDA Programming Guide, "Lazy Loading": it cuts the context's device memory);
users see ~0.5-0.8 GB per process in nvidia-smi before allocating anything (pytorch/pytorch#34323:
781 MB), more once cuBLAS/cuDNN/NCCL have initialized. The default, 512 MiB, is in that range;
tests choose theirs with GPUSWAP_SIM_CONTEXT_BYTES (read only on simulated GPUs).

One registration per process, on its first visible GPU (simcuda's model: one GPU per process; a
rank of a multi-rank job on visible GPU LOCAL_RANK, `bind`), so
a simulated job that spreads tensors over several GPUs shows its floor on the first one only.
Training thread only (as every walk of the attached tensors): no lock is needed.
"""
from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR

DEFAULT_CONTEXT_BYTES = 512 * 2**20

_registered: Optional[int] = None       # bytes last registered by this process (None: not yet)
_pid: Optional[int] = None              # ... and by which process (a fork is a process of its own)
_floor: Optional[int] = None            # context_bytes(), read once
_device = 0                             # ordinal within CUDA_VISIBLE_DEVICES (a rank's LOCAL_RANK)


def bind(device: int) -> None:
    """Register on visible device `device` instead of the first: a rank of a multi-rank job uses
    cuda:LOCAL_RANK, as torchrun scripts do, so its context floor sits on its own GPU."""
    global _device, _registered
    visible = len(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(","))
    if device != _device and 0 <= device < visible:     # more ranks than GPUs: they share the first
        _device, _registered = device, None


def context_bytes(env: Mapping[str, str] = os.environ) -> int:
    """The simulated context floor: $GPUSWAP_SIM_CONTEXT_BYTES (bytes, or a size such as 256MiB),
    else the default; a value that cannot be read is reported once and the default used."""
    text = env.get(SIM_CONTEXT_BYTES, "").strip()
    if not text:
        return DEFAULT_CONTEXT_BYTES
    from gpuswap.jobs import parse_size

    try:
        value = parse_size(text)
        if 0 <= value <= 2**50:
            return value
    except ValueError:
        pass
    print(f"gpuswap: ignoring {SIM_CONTEXT_BYTES}={text[:40]!r}: not a size; using {DEFAULT_CONTEXT_BYTES} bytes",
          file=sys.stderr, flush=True)
    return DEFAULT_CONTEXT_BYTES


def hold(attached_bytes: int, simulated: bool) -> None:
    """This process now holds the floor plus `attached_bytes` on its simulated GPU (registered on
    the first call). Nothing happens on real GPUs or outside a daemon's simulated GPUs.

    A CUDA call: while the driver holds the process (a job frozen transparently) it blocks until
    the thaw (simcuda.allocate), as a real allocation would. Callers (the training thread) hold no
    lock of the runtime's around it: its reader thread, which answers the daemon, never waits on it."""
    global _registered, _pid, _floor
    if not simulated:
        return
    if not os.environ.get(SIM_CUDA_DIR):
        return
    if _floor is None:
        _floor = context_bytes()
    total = _floor + max(0, int(attached_bytes))
    if total == _registered and _pid == os.getpid():
        return
    from gpuswap import simcuda

    try:
        simcuda.allocate(total, device=_device)
    except (OSError, ValueError, IndexError) as exc:   # a bad CUDA_VISIBLE_DEVICES, a full disk
        print(f"gpuswap: could not register with the simulated GPU: {exc}", file=sys.stderr, flush=True)
        return
    _registered, _pid = total, os.getpid()
