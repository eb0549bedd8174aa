"""One NCCL rank on one GPU through a multi-rank RAM park's own steps (issue 13's GPU evidence).

NCCL refuses two ranks on one device, so a one-GPU machine cannot run a multi-rank job; what it can
run is the rank's side of the park with a real NCCL group: `RankJob._carry_out` with the actions the
coordinator sends (park -> unpark -> regroup), which destroys the NCCL group, parks the attached
tensors in pinned host memory, drops DDP's Reducer (its bucket buffers), then makes all of it again.

    python nccl_one_rank_job.py MODE OUT.json       MODE: plain | parked | floor

Prints nothing; writes what it measured to OUT.json: this process's GPU memory as NVML lists it
(context only, after training, while parked, after resume), the parameters' sha256 at the end.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pynvml
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.objects import classify
from gpuswap.runtime.rankcursor import PARK, REGROUP, UNPARK
from gpuswap.runtime.ranks import RankIdentity, RankJob

STEPS, PARK_AT, HIDDEN = 30, (10, 20, 25), 2048


def nvml_used() -> int | None:
    """This process's device memory as NVML lists it (context, NCCL, the caching allocator)."""
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            return int(p.usedGpuMemory or 0)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    seen = {"context": nvml_used()}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    if mode == "floor":     # what a process keeps once it has had an NCCL group (NCCL's own code)
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        del t
        dist.destroy_process_group()
        torch.cuda.empty_cache()
        seen["floor"] = nvml_used()
        with open(out, "w") as f:
            json.dump(seen, f)
        return
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(),
                                    torch.nn.Linear(4 * HIDDEN, HIDDEN)).cuda(), device_ids=[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    job = RankJob([classify("model", model), classify("opt", opt)],
                  RuntimeConfig(job_id="nccl-one", control=None, ckpt_dir=None, simulated=False),
                  RankIdentity(0, 1, 0))
    refusal, parks = job._ram_refusal, []
    for step in range(STEPS):
        x = torch.randn(64, HIDDEN, device="cuda", generator=gen)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        if mode == "parked" and step + 1 in PARK_AT:
            torch.cuda.synchronize()
            before = nvml_used()
            ok, info = job._carry_out(PARK)
            assert ok, info
            assert not dist.is_initialized(), "the NCCL group survived the park"
            dropped = model.reducer is None
            during, reserved = nvml_used(), torch.cuda.memory_reserved()
            ok, back = job._carry_out(UNPARK)
            assert ok, back
            job._cursor.epoch = len(parks) + 1
            ok, regroup = job._carry_out(REGROUP)
            assert ok, regroup
            assert dist.is_initialized() and dist.get_backend() == "nccl"
            torch.cuda.synchronize()
            parks.append({"step": step + 1, "before": before, "during": during, "after": nvml_used(),
                          "park_s": info["seconds"], "bytes": info["bytes"], "unpark_s": back["seconds"],
                          "regroup_s": regroup["seconds"],
                          "reducer_dropped": dropped, "reserved_during": reserved})
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    seen.update(parks=parks, sha256=h.hexdigest(), refusal=refusal, end=nvml_used(),
                torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
