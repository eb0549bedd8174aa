"""What stays on the GPU after a cooperative RAM park, measured per process through NVML.

A park by the job's runtime copies its attached tensors to host RAM and empties the caching
allocator; its CUDA context (~0.3-0.7 GB, more once cuBLAS/cuDNN/NCCL are up), library workspaces,
CUDA-graph and torch.compile pools and tensors it did not attach stay on the device (issue 12,
bug 5). When the daemon sees such a park complete, it reads NVML's per-process usage
(`nvmlDeviceGetComputeRunningProcesses`; on simulated GPUs the simulated device's list, where every
simulated CUDA process holds its context, the floor: gpuswap.simcuda, runtime/simdevice.py) for
the job's process tree on its home GPUs, and keeps the figure per GPU on the job
(`JobRecord.residue`). The policy treats it as memory still taken on those GPUs
(policy/residue.py); `ls`, `show`, `gpus`, `top` and the dashboard show it.

The figure also stands, after the job resumes, for what its next RAM park will leave. Before a
job's first RAM park the policy assumes 0, because nothing truthful is known: NVML's figure for
a running process also counts the allocator's cache of freed blocks, which the park returns to
the driver (often more than the attached tensors), and from outside the process the part that
stays cannot be told apart from it. A first park that leaves more than the job taking its GPU can
fit beside is corrected at the next round: that job is not started into it; the parked job is
spilled to disk if the rules let that job pause it, else it waits with the reason.
"""
from __future__ import annotations

from typing import Iterable

from gpuswap.jobs import JobState, format_size
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.store import JobRecord
from gpuswap.node.transparent import job_cuda_processes


def measure(job_pid: int | None, gpus: GpuInventory, home: Iterable[int]) -> dict[int, int]:
    """GPU -> bytes the job's processes hold on its home GPUs now (NVML, per process)."""
    if not job_pid:
        return {}
    home = set(home)
    out: dict[int, int] = {}
    for c in job_cuda_processes(job_pid, gpus):
        if c.gpu in home and c.nbytes > 0:
            out[c.gpu] = out.get(c.gpu, 0) + c.nbytes
    return out


def kept_now(j: JobRecord) -> dict[int, int]:
    """What the job keeps on its GPUs now: its residue while it is parked in RAM by its runtime."""
    if j.state == JobState.PAUSED and j.parked == "ram" and j.mechanism == "cooperative":
        return {g: n for g, n in j.residue.items() if n > 0}
    return {}


def text(residue: dict[int, int]) -> str:
    """'512.0 MiB stays on GPU 0' (per GPU, joined), or '' when nothing stays."""
    return "; ".join(f"{format_size(n)} stays on GPU {g}" for g, n in sorted(residue.items()) if n > 0)


def outside_snapshot(jobs: Iterable[JobRecord], in_snapshot: set[int]) -> dict[int, int]:
    """GPU -> bytes kept by RAM-parked jobs the policy does not see (held by their users)."""
    out: dict[int, int] = {}
    for j in jobs:
        if j.id not in in_snapshot:
            for g, n in kept_now(j).items():
                out[g] = out.get(g, 0) + n
    return out
