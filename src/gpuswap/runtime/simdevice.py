"""On simulated GPUs, a job that uses the runtime is a simulated CUDA process, as a real one is.

A real training process holds device memory the runtime never attaches: its CUDA context (module
code, the driver's per-context buffers), library handles and workspaces (cuBLAS, cuDNN, NCCL),
CUDA-graph and torch.compile pools, tensors it did not attach. A cooperative RAM park frees the
attached tensors and the allocator's cache, never that floor: NVML keeps listing the process with
it. Without a GPU the daemon finds a job's device memory only in the simulated device's process
list (gpuswap.simcuda), so the runtime registers its process there with

    attached device bytes + DDP bucket buffers    (CPU tensors stand for device memory in simulation)

and the simulated device adds the process's CUDA context on each GPU it uses, as any CUDA process
holds one on every GPU it touched (simcuda.DEFAULT_CONTEXT_BYTES, with its sources; GPUSWAP_SIM_CONTEXT_BYTES for tests): that is
the floor a park cannot free. The registration is updated whenever a measurement changes: at
attach, at each measured safepoint, before a RAM park is reported (nothing attached, so the
context alone, plus the bucket buffers of any DDP Reducer the park keeps) and before a resume is
reported (all of it again). A disk park exits, and the registration dies with the process. DDP's
Reducer holds one flat buffer per bucket, about one more copy of the gradients, in no tensor the
job attached; a real process's NVML figure includes them, so the simulated one does too
(runtime/ddpreducer.py: a multi-rank RAM park frees them unless a reason keeps the Reducer; a
single-process park never does). Not modelled: the caching allocator's cache, activations,
tensors not attached, a communication hook's own result buffers.

The floor is the simulated context on each of its GPUs (simcuda.DEFAULT_CONTEXT_BYTES): 512 MiB by default, in the
range PyTorch processes show (pytorch/pytorch#86509, #34323; library handles and workspaces
included once cuBLAS/cuDNN/NCCL have initialized).

Per GPU, as a real process (simcuda: a context on each GPU the process touched). Without a GPU the
attached tensors are CPU tensors and say nothing of a device, so the job says which simulated GPUs
they live on: GPUSWAP_SIM_DEVICES, device ordinals within CUDA_VISIBLE_DEVICES ("0,1", or "all"),
over which the bytes are spread evenly (the remainder on the first); unset, the bound device alone
(a rank of a multi-rank job: visible GPU LOCAL_RANK, `bind`; else the first). Each of those GPUs
shows the process with a context there, so a RAM park leaves the floor on each, as a real one
does. Not modelled: an uneven spread (a real job's tensors are where its code put them).

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

A step is a CUDA call too: `Job.safepoint` begins with `step`, which blocks while the driver holds
the process (locked or checkpointed by a transparent freeze), as a real step's kernel launches do;
so a simulated job the driver holds reaches no safepoint, as a real one does not.

Training thread only (as every walk of the attached tensors): no lock is needed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from gpuswap import simcuda
from gpuswap.protocol.env import SIM_CUDA_DIR, SIM_DEVICES
from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES, context_bytes   # noqa: F401 (the floor: simcuda's context)

_registered: Optional[tuple[int, tuple[int, ...]]] = None   # (bytes, devices) last registered (None: not yet)
_pid: Optional[int] = None              # ... and by which process (a fork is a process of its own)
_reg: Optional[simcuda.Registration] = None   # ... and the registration itself (for `step`)
_device = 0                             # ordinal within CUDA_VISIBLE_DEVICES (a rank's LOCAL_RANK)
_warned = False                         # GPUSWAP_SIM_DEVICES could not be read (said once)


def bind(device: int) -> None:
    """Register on visible device `device` instead of the first: a rank of a multi-rank job uses
    cuda:LOCAL_RANK, as torchrun scripts do, so its context floor sits on its own GPU (unless
    GPUSWAP_SIM_DEVICES names the devices: `devices`)."""
    global _device, _registered
    visible = len(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(","))
    if device != _device and 0 <= device < visible:     # more ranks than GPUs: they share the first
        _device, _registered = device, None


def devices() -> tuple[int, ...]:
    """The visible device ordinals this process's attached tensors live on (module docstring):
    GPUSWAP_SIM_DEVICES, else the bound device. A value that names no visible device, or repeats
    one, is reported once and the bound device used."""
    global _warned
    text = os.environ.get(SIM_DEVICES, "").strip()
    if not text:
        return (_device,)
    visible = len(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(","))
    if text == "all":
        return tuple(range(visible))
    try:
        found = tuple(int(e) for e in text.split(","))
        if found and len(set(found)) == len(found) and all(0 <= d < visible for d in found):
            return found
    except ValueError:
        pass
    if not _warned:
        _warned = True
        print(f"gpuswap: ignoring {SIM_DEVICES}={text[:40]!r}: not distinct device ordinals below {visible} "
              f"(or 'all'); using device {_device}", file=sys.stderr, flush=True)
    return (_device,)


def hold(attached_bytes: int, simulated: bool) -> None:
    """This process now holds `attached_bytes`, spread over its simulated GPUs (`devices`), beside
    its CUDA context on each, which the simulated device adds (on the first call there). Nothing
    happens on real GPUs or outside a daemon's simulated GPUs.

    A CUDA call: while the driver holds the process (a job frozen transparently) it blocks until
    the thaw (simcuda.allocate), as a real allocation would. Callers (the training thread) hold no
    lock of the runtime's around it: its reader thread, which answers the daemon, never waits on it.
    A full GPU raises at the first device without room; those before it hold their new share, as a
    real refill that fails part-way has allocated what it did (the next call tries again)."""
    global _registered, _pid, _reg
    if not simulated:
        return
    if not os.environ.get(SIM_CUDA_DIR):
        return
    total, where = max(0, int(attached_bytes)), devices()
    if (total, where) == _registered and _pid == os.getpid():
        return
    share, extra = divmod(total, len(where))
    try:
        for i, device in enumerate(where):
            reg = simcuda.allocate(share + (extra if i == 0 else 0), device=device)
    except simcuda.OutOfMemoryError as exc:            # the GPU is full: what torch would raise here
        raise as_torch_error(exc) from exc
    except (OSError, ValueError, IndexError) as exc:   # a bad CUDA_VISIBLE_DEVICES, a full disk
        print(f"gpuswap: could not register with the simulated GPU: {exc}", file=sys.stderr, flush=True)
        return
    _registered, _pid, _reg = (total, where), os.getpid(), reg


def step() -> None:
    """The CUDA calls of the training step that just ended (simulated GPUs; `Job.safepoint` makes
    it before anything else): blocks while the driver holds this process, locked or checkpointed,
    and for good once a failed restore left it stuck (simcuda.sync). On a real GPU every step
    launches kernels, and a process the driver locked blocks at the first ("block further CUDA API
    calls", CUDA docs, cuCheckpointProcessLock; cuda-checkpoint README: CPU threads calling CUDA
    "may block until CUDA is resumed"), so it reaches no safepoint, serves no pause and reports no
    measurement until the thaw. Before this, a simulated job the driver held kept stepping on its
    CPU tensors and served pauses at its safepoints; only a registration that changed (`hold`)
    blocked. One read of the driver's record for this pid (absent until the driver first touches
    the process); nothing before this process registered (no CUDA process: nothing blocks it)."""
    reg = _reg
    if reg is None or _pid != os.getpid():
        return
    root = os.environ.get(SIM_CUDA_DIR)
    if root:
        simcuda.wait_while_held(simcuda.SimDevice(Path(root)), reg)


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
