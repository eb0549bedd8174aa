"""A fresh process for one GPU scenario of test_rt_park_gpu.py; prints one JSON line of facts.

    python gpu_park_child.py floor|devices|graph|wrappers

A child of its own, so that NVML's per-process figures and the process's RSS are this scenario's
alone (the test process may hold a CUDA context and pinned memory of its own).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time

import torch

from gpuswap.runtime import parking, pinned

MiB = 1 << 20


def nvml_by_uuid(pid: int) -> dict[str, int]:
    """{GPU uuid: bytes NVML says this pid uses there} for every GPU that lists the pid."""
    import pynvml

    pynvml.nvmlInit()
    out: dict[str, int] = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        key = (uuid.decode() if isinstance(uuid, bytes) else uuid).removeprefix("GPU-")
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid:
                out[key] = out.get(key, 0) + int(p.usedGpuMemory or 0)
    return out


def torch_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def digest(t: torch.Tensor) -> list[int]:
    """A bitwise fingerprint computed on the device: (sum, position-weighted sum) of the bytes as
    int32 words, in chunks (integer sums wrap identically whatever the order)."""
    words = t.detach().reshape(-1).view(torch.uint8)
    words = words[: words.numel() // 4 * 4].view(torch.int32)
    total = weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    step = 16 * MiB
    for start in range(0, words.numel(), step):
        chunk = words[start:start + step].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
        total = total + chunk.sum()
        weighted = weighted + (chunk * pos).sum()
    return [int(total), int(weighted)]


def train_state(device: str, width: int, layers: int, wrap=None):
    # CPU generator only: seeding every CUDA generator is no business of a one-device scenario
    torch.random.default_generator.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    if wrap is not None:
        for layer in model:
            for name in ("weight", "bias"):
                w = getattr(layer, name).detach()
                setattr(layer, name, torch.nn.Parameter(wrap(w)))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, width).to(device)
    model(x).sum().backward()
    opt.step()
    del x
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if v.is_cuda]
    return model, opt, tensors


def floor() -> dict:
    """Context + cuBLAS + the training step's kernels, nothing allocated: the floor. Then ~2 GiB
    of training state, parked twice (the second from the pool), each measured while parked."""
    pid = os.getpid()
    dev = torch.device("cuda", 0)
    uuid = torch_uuid(0)
    m, o, t = train_state("cuda:0", 64, 2)
    del m, o, t
    torch.cuda.synchronize()
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    torch.cuda.empty_cache()
    out: dict = {"reserved_at_floor": torch.cuda.memory_reserved(dev)}
    out["floor"] = nvml_by_uuid(pid).get(uuid, 0)
    model, opt, tensors = train_state("cuda:0", 8192, 2)   # 2 x 256 MiB weights, x4 with grads, Adam
    before = [digest(t) for t in tensors]
    storages = [t.untyped_storage()._cdata for t in tensors]
    torch.cuda.synchronize()
    out["held"] = nvml_by_uuid(pid).get(uuid, 0)
    pool = pinned.pool_for(simulated=False)
    parks = []
    for _ in range(2):
        rss0 = rss()
        park = parking.copy_to_host(tensors, simulated=False)
        parking.release(park, simulated=False)
        parks.append({
            "nbytes": park.nbytes, "pinned": park.pinned,
            "host_pinned": all(s.host.is_pinned() for s in park.slots.values()),
            "host_ptrs": sorted(s.host.data_ptr() for s in park.slots.values()),
            "host_bytes": park.lease.host_bytes, "rss_growth": rss() - rss0,
            "nvml": nvml_by_uuid(pid).get(uuid, 0), "reserved": torch.cuda.memory_reserved(dev),
            "allocated": torch.cuda.memory_allocated(dev), "slabs_made": pool.stats().slabs_made,
            "device_bytes": parking.device_bytes(tensors, simulated=False),
        })
        t0 = time.perf_counter()
        parking.restore(park, simulated=False)
        parking.drop_host(park)
        parks[-1]["resume_s"] = time.perf_counter() - t0
        parks[-1]["pinned_after_resume"] = pool.stats().pinned_bytes  # nothing unpinned inside it
    out["parks"] = parks
    out["bitwise"] = [digest(t) for t in tensors] == before
    out["same_storages"] = [t.untyped_storage()._cdata for t in tensors] == storages
    out["same_params"] = all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))
    rss_idle = rss()
    pool.release_idle()
    out["released"] = pool.wait_released(timeout=300)
    out["rss_freed_by_release"] = rss_idle - rss()
    out["pinned_after_release"] = pool.stats().pinned_bytes
    return out


def devices() -> dict:
    """State on cuda:1 only: no other GPU may get a context from the runtime."""
    pid = os.getpid()
    model, opt, tensors = train_state("cuda:1", 2048, 2)
    torch.cuda.synchronize("cuda:1")
    out = {"uuid1": torch_uuid(1), "before": sorted(nvml_by_uuid(pid))}
    before = [digest(t) for t in tensors]
    park = parking.copy_to_host(tensors, simulated=False)
    parking.release(park, simulated=False)
    out["parked"] = sorted(nvml_by_uuid(pid))
    parking.restore(park, simulated=False)
    parking.drop_host(park)
    pool = pinned.pool_for(simulated=False)
    pool.release_idle()
    pool.wait_released(timeout=300)
    out["after"] = sorted(nvml_by_uuid(pid))
    out["bitwise"] = [digest(t) for t in tensors] == before
    return out


class Recorder:
    """Where the runtime's control messages go instead of a supervisor's socket."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: object) -> bool:
        from gpuswap.protocol.records import wire

        self.sent.append(wire(msg))     # what the socket would carry (JSON-ready: the result file)
        return True

    def close(self) -> None:
        pass


def graph() -> dict:
    """A captured CUDA graph: the RAM park is refused with the reason; with a checkpoint
    directory the pause becomes a disk park that says why and leaves device memory in place."""
    import gpuswap

    model = torch.nn.Linear(1024, 1024).cuda()
    static_in = torch.randn(32, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = model(static_in)
    g.replay()
    torch.cuda.synchronize()
    want = static_out.clone()
    ptrs = [p.data_ptr() for p in model.parameters()]
    os.environ.update(GPUSWAP_JOB_ID="gpu-graph")
    os.environ.pop("GPUSWAP_SIMULATED_GPU", None)
    os.environ.pop("GPUSWAP_CONTROL", None)
    os.environ.pop("GPUSWAP_CKPT_DIR", None)
    out: dict = {}
    try:
        parking.copy_to_host(list(model.parameters()), simulated=False)
        out["direct"] = "parked"
    except parking.ParkRefused as exc:
        out["direct"] = str(exc)
        out["disk_ok"] = exc.disk_ok
    job = gpuswap.attach(model=model)
    job._client = rec = Recorder()
    job.request_pause("ram")
    job.safepoint(1)
    out["no_ckpt_msgs"] = rec.sent
    out["no_ckpt_parked"] = job.parked
    g.replay()
    torch.cuda.synchronize()
    out["replay_ok"] = torch.equal(static_out, want)
    out["ptrs_kept"] = [p.data_ptr() for p in model.parameters()] == ptrs
    os.environ["GPUSWAP_CKPT_DIR"] = tempfile.mkdtemp()
    job = gpuswap.attach(model=model)
    job._client = rec = Recorder()
    allocated = torch.cuda.memory_allocated()
    job.request_pause("ram")
    try:
        job.safepoint(2)
        out["exit"] = None
    except SystemExit as exc:
        out["exit"] = exc.code
    out["ckpt_msgs"] = rec.sent
    out["ckpt_ptrs_kept"] = [p.data_ptr() for p in model.parameters()] == ptrs
    out["ckpt_allocated_kept"] = torch.cuda.memory_allocated() == allocated
    return out


def wrappers() -> dict:
    """TwoTensor parameters, gradients and Adam state on CUDA, parked through the runtime."""
    import gpuswap
    from torch.testing._internal.two_tensor import TwoTensor

    model, opt, tensors = train_state("cuda:0", 1024, 2, wrap=lambda w: TwoTensor(w.clone(), w.clone() * 2))
    inner = [x for t in tensors for x in ((t.a, t.b) if isinstance(t, TwoTensor) else (t,))]
    out: dict = {"wrapped": sum(isinstance(t, TwoTensor) for t in tensors), "tensors": len(tensors)}
    before = [digest(x) for x in inner]
    os.environ.update(GPUSWAP_JOB_ID="gpu-wrappers")
    for k in ("GPUSWAP_SIMULATED_GPU", "GPUSWAP_CONTROL", "GPUSWAP_CKPT_DIR"):
        os.environ.pop(k, None)
    job = gpuswap.attach(model=model, optimizer=opt)
    job._client = rec = Recorder()
    out["device_bytes"] = job.device_bytes()
    out["inner_bytes"] = sum({x.untyped_storage()._cdata: x.untyped_storage().nbytes() for x in inner}.values())
    seen: dict = {}

    def drive() -> None:
        while not job.parked:
            time.sleep(0.001)
        seen["allocated"] = torch.cuda.memory_allocated()
        seen["inner_sizes"] = sorted({x.untyped_storage().nbytes() for x in inner})
        job.request_resume()

    job.request_pause("ram")
    t = threading.Thread(target=drive)
    t.start()
    job.safepoint(1)
    t.join(300)
    out.update(seen)
    out["msgs"] = [m["op"] for m in rec.sent]
    out["paused_bytes"] = next((m["bytes"] for m in rec.sent if m["op"] == "paused"), None)
    out["bitwise"] = [digest(x) for x in inner] == before
    out["same_inner"] = all(a is b for a, b in zip(
        [x for t in tensors for x in ((t.a, t.b) if isinstance(t, TwoTensor) else (t,))], inner))
    return out


if __name__ == "__main__":
    result = {"floor": floor, "devices": devices, "graph": graph, "wrappers": wrappers}[sys.argv[1]]()
    print(json.dumps(result), flush=True)
    os._exit(0)  # a disk park's exit watchdog must not outlive the answer
