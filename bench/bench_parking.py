"""Parking on a real GPU at 4 and 16 GiB, each against a plain pinned copy of the same bytes
measured in the same run.

    python bench/bench_parking.py [--sizes 4,16] [--steps 300]

- pinned copy (the reference): `torch.empty(pin_memory=True)`, then one device-to-host and one
  host-to-device copy of SIZE bytes, timed alone (the allocation is timed apart: it is what a
  park paid each time before the runtime kept a pool).
- cooperative: a job holding SIZE bytes of state (`gpuswap.attach`), parked to RAM and resumed
  twice through the runtime's own code (safepoint -> pausing -> parking -> pinned pool); the
  first park maps and pins its host buffers (pool cold), the second reuses them (pool warm).
  Seconds are the ones the runtime reports in its `paused`/`resumed` messages.
- cooperative, pause asked one step ahead: a fresh job (pool cold) whose pause arrives as its
  step starts (a step of ~AHEAD seconds of GPU work, `--ahead-s`), once with the host buffers
  prepared at the request (runtime/prefault.py) and once without (`GPUSWAP_PREFAULT=0`, what a
  cold park did before). Reported: the park as the runtime times it, the latency from the request
  to the GPU memory being free (the step's remainder included), and that step's time against
  the same step with no pause asked (the preparation must not slow training).
- transparent: an unmodified process holding SIZE bytes frozen and thawed through the driver
  checkpoint API (the CudaCheckpointDriver the daemon uses), compared bitwise with an
  uninterrupted run of the same script.

Each part runs in a fresh process holding only the SIZE bytes it reports (no extra copies; hashes
are computed on the GPU). NVML shows each process's GPU memory while parked or frozen.
Goals: cooperative park >= 0.8x the pinned device-to-host bandwidth; transparent freeze >= 2x
cuda-checkpoint's published 2.7 GB/s (3.6 GB in 1.3 s, thaw 0.83 s, H100 PCIe).
Without a GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GIB = 1 << 30
CHUNK = 256 << 20
PUBLISHED_FREEZE_BPS = 3.6e9 / 1.3
PARK_GOAL = 0.8
FREEZE_GOAL = 2.0

# A bitwise fingerprint computed on the GPU, in 64 MiB pieces (integer sums wrap identically in
# any order): no host copy of the state is ever made. Shared by the children below.
GPU_HASH = r'''
import hashlib, torch
def gpu_hash(tensors):
    h = hashlib.sha256()
    for t in tensors:
        words = t.detach().reshape(-1).view(torch.int32)
        for start in range(0, words.numel(), 16 << 20):
            w = words[start:start + (16 << 20)].to(torch.int64)
            pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
            h.update(f"{int(w.sum())},{int((w * pos).sum())};".encode())
    return h.hexdigest()
'''

# The unmodified training script for the transparent part: no gpuswap import. SIZE bytes of
# state made in place (no temporaries left in the allocator's cache), STEPS deterministic steps
# (sleeping a little so a freeze lands mid-run), then its hash.
TRANSPARENT_CHILD = GPU_HASH + r'''
import sys, time
size, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
n = size // 8
w = torch.empty(n, device="cuda").normal_().mul_(0.01)
opt_state = torch.zeros_like(w)
x = torch.randn(4096, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
for step in range(steps):
    g = torch.sin(w[:4096] * x).sum() * 1e-3
    w.mul_(0.999).add_(g)
    opt_state.add_(w, alpha=0.1)
    torch.cuda.synchronize()
    time.sleep(0.01)
print("hash", gpu_hash([w, opt_state]), flush=True)
'''


def nvml_used(pid: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid)
    return total


# -- children (each a fresh process: `--child KIND SIZE`) -----------------------------------
def child_pinned(nbytes: int) -> dict:
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    alloc = time.perf_counter() - t0
    small = 64 << 20
    host[:small].copy_(dev[:small], non_blocking=True)  # warm up the copy engines and the path
    dev[:small].copy_(host[:small], non_blocking=True)
    torch.cuda.synchronize()
    best = {"d2h_s": float("inf"), "h2d_s": float("inf")}
    for _ in range(2):
        for key, dst, src in (("d2h_s", host, dev), ("h2d_s", dev, host)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best[key] = min(best[key], time.perf_counter() - t0)
    return {"alloc_s": alloc, **best}


class _Recorder:
    """Takes the runtime's control messages in place of a supervisor's socket."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: object) -> bool:
        from gpuswap.protocol.records import wire

        self.sent.append(wire(msg))     # what the socket would carry
        return True

    def close(self) -> None:
        pass


def _job_state(nbytes: int, **env: str) -> tuple[dict, list]:
    """In a child: the environment of a job run outside any daemon (`env`: more of it), and its
    state, `nbytes` on the GPU in 256 MiB tensors; with the scope holding `gpu_hash`."""
    os.environ.update(GPUSWAP_JOB_ID="bench-parking", GPUSWAP_PINNED_KEEP_S="600", **env)
    for k in ("GPUSWAP_CONTROL", "GPUSWAP_CKPT_DIR", "GPUSWAP_SIMULATED_GPU"):
        os.environ.pop(k, None)
    import torch

    scope: dict = {}
    exec(GPU_HASH, scope)
    torch.manual_seed(0)
    return scope, [torch.empty(CHUNK // 4, device="cuda").normal_() for _ in range(nbytes // CHUNK)]


def child_cooperative(nbytes: int) -> dict:
    import torch

    import gpuswap

    scope, state = _job_state(nbytes)
    torch.cuda.synchronize()
    before = scope["gpu_hash"](state)
    torch.cuda.empty_cache()  # the hash's temporaries: the job holds only its state
    job = gpuswap.attach(state=state)
    job._client = rec = _Recorder()
    out: dict = {"held": nvml_used(os.getpid())}
    for r in range(2):
        seen: dict = {}

        def resume_when_parked() -> None:
            while not job.parked:
                time.sleep(0.0005)
            seen["nvml"] = nvml_used(os.getpid())
            job.request_resume()

        job.request_pause("ram")
        t = threading.Thread(target=resume_when_parked)
        t.start()
        job.safepoint(r)
        t.join()
        paused = [m for m in rec.sent if m["op"] == "paused"][-1]
        resumed = [m for m in rec.sent if m["op"] == "resumed"][-1]
        errors = [m["message"] for m in rec.sent if m["op"] == "error"]
        if errors:
            raise RuntimeError(errors[-1])
        out[f"round{r}"] = {"park_s": paused["seconds"], "resume_s": resumed["seconds"],
                            "bytes": paused["bytes"], "nvml_parked": seen["nvml"]}
    out["bitwise"] = scope["gpu_hash"](state) == before
    return out


def child_ahead(nbytes: int, prepare: bool, ahead_s: float) -> dict:
    """A cold park whose pause is asked as a step of ~ahead_s seconds starts (see the docstring)."""
    import torch

    import gpuswap
    from gpuswap.runtime import pinned, prefault

    scope, state = _job_state(nbytes, GPUSWAP_PREFAULT="1" if prepare else "0")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = scope["gpu_hash"](state)
    torch.cuda.empty_cache()

    def step(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, a)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    step(20)
    k = max(1, int(20 * ahead_s / step(20)))      # matmuls per step of ~ahead_s seconds
    plain = sorted(step(k) for _ in range(3))[1]
    job = gpuswap.attach(state=state)
    job._client = rec = _Recorder()
    seen: dict = {}

    def resume_when_parked() -> None:
        while not job.parked:
            time.sleep(0.0002)
        seen["free_at"] = time.perf_counter()
        seen["nvml"] = nvml_used(os.getpid())
        job.request_resume()

    t = threading.Thread(target=resume_when_parked)
    t.start()
    asked = time.perf_counter()
    job.request_pause("ram")          # as the control thread does when the daemon's pause comes
    during = step(k)                  # the step the pause arrived in
    job.safepoint(0)
    t.join()
    errors = [m["message"] for m in rec.sent if m["op"] == "error"]
    if errors:
        raise RuntimeError(errors[-1])
    paused = [m for m in rec.sent if m["op"] == "paused"][-1]
    return {"step_s": plain, "step_during_s": during, "park_s": paused["seconds"],
            "latency_s": seen["free_at"] - asked, "nvml_parked": seen["nvml"],
            "prefault": vars(prefault.stats(pinned.pool_for(False))),
            "bitwise": scope["gpu_hash"](state) == before}


def run_child(kind: str, nbytes: int, *extra: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", kind, str(nbytes), *extra], capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit " + str(p.returncode)])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_transparent(script: Path, nbytes: int, steps: int, driver=None) -> dict:
    p = subprocess.Popen([sys.executable, str(script), str(nbytes), str(steps)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        p.wait()
        return {"error": "the script did not start"}
    out: dict = {}
    if driver is not None:
        time.sleep(0.5)
        out["before"] = nvml_used(p.pid)
        t0 = time.perf_counter()
        driver.lock(p.pid, 10_000)
        out["lock_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        driver.checkpoint(p.pid)
        out["checkpoint_s"] = time.perf_counter() - t0
        time.sleep(0.5)
        out["frozen"] = nvml_used(p.pid)
        t0 = time.perf_counter()
        driver.restore(p.pid)
        out["restore_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        driver.unlock(p.pid)
        out["unlock_s"] = time.perf_counter() - t0
    for line in p.stdout:
        if line.startswith("hash"):
            out["hash"] = line.split()[1]
    p.wait()
    return out


# -- the table ------------------------------------------------------------------------------
def machine() -> tuple[str, str]:
    import pynvml
    import torch

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    name, driver = pynvml.nvmlDeviceGetName(h), pynvml.nvmlSystemGetDriverVersion()
    name = name.decode() if isinstance(name, bytes) else name
    driver = driver.decode() if isinstance(driver, bytes) else driver
    return name, f"driver {driver}, torch {torch.__version__} (CUDA {torch.version.cuda})"


def transparent_driver():
    try:
        from gpuswap.node import cuda_ckpt
        from gpuswap.node.gpus import NvmlGpus

        gpus = NvmlGpus()
        cap = cuda_ckpt.detect(gpus.persistence(), gpus.driver)
        if not cap.available:
            return None, cap.reason
        return cuda_ckpt.CudaCheckpointDriver(cap), f"cuda-bindings {cap.bindings}"
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,16", help="GiB, comma-separated (default 4,16)")
    ap.add_argument("--steps", type=int, default=300, help="steps of the transparent part's script")
    ap.add_argument("--ahead-s", type=float, default=0.5,
                    help="the step a pause arrives in, seconds of GPU work (default 0.5)")
    ap.add_argument("--parts", default="cooperative,ahead,transparent",
                    help="which parts to run (default all: cooperative,ahead,transparent)")
    ap.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, nbytes = a.child[0], int(a.child[1])
        if kind == "ahead":
            out = child_ahead(nbytes, a.child[2] == "1", float(a.child[3]))
        else:
            out = {"pinned": child_pinned, "cooperative": child_cooperative}[kind](nbytes)
        print(json.dumps(out), flush=True)
        os._exit(0)
    parts = set(a.parts.split(","))
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        name, versions = machine()
    except Exception as e:
        console.print(f"bench_parking needs an NVIDIA GPU ({e}): nothing measured")
        return 0
    driver, driver_note = transparent_driver()
    script = Path(tempfile.mkdtemp()) / "unmodified_job.py"
    script.write_text(TRANSPARENT_CHILD)
    t = Table(title=f"parking vs a pinned copy of the same bytes - {name}, {versions}")
    for col in ("GiB", "what", "seconds", "GB/s", "vs pinned", "GPU memory (NVML)", "bitwise"):
        t.add_column(col)
    goals: list[str] = []
    for gib in (float(s) for s in a.sizes.split(",")):
        nbytes = int(gib * GIB) // CHUNK * CHUNK
        ref = run_child("pinned", nbytes)
        if "error" in ref:
            t.add_row(f"{gib:g}", "pinned copy", ref["error"], "", "", "", "")
            continue
        gbs = lambda s: f"{nbytes / s / 1e9:.1f}"  # noqa: E731
        t.add_row(f"{gib:g}", "pinned D2H copy (reference)", f"{ref['d2h_s']:.3f}", gbs(ref["d2h_s"]), "1.00", "", "")
        t.add_row(f"{gib:g}", "pinned H2D copy (reference)", f"{ref['h2d_s']:.3f}", gbs(ref["h2d_s"]), "1.00", "", "")
        t.add_row(f"{gib:g}", "fresh pin_memory=True allocation", f"{ref['alloc_s']:.3f}", "", "", "", "")
        co = run_child("cooperative", nbytes) if "cooperative" in parts else {"skipped": True}
        if "skipped" in co:
            pass
        elif "error" in co:
            t.add_row(f"{gib:g}", "cooperative", co["error"], "", "", "", "")
        else:
            for r, label in ((0, "pool cold"), (1, "pool warm")):
                x = co[f"round{r}"]
                t.add_row(f"{gib:g}", f"cooperative park ({label})", f"{x['park_s']:.3f}", gbs(x["park_s"]),
                          f"{ref['d2h_s'] / x['park_s']:.2f}",
                          f"{co['held'] / GIB:.2f} -> {x['nvml_parked'] / GIB:.2f} GiB", "")
                t.add_row(f"{gib:g}", f"cooperative resume ({label})", f"{x['resume_s']:.3f}", gbs(x["resume_s"]),
                          f"{ref['h2d_s'] / x['resume_s']:.2f}", "", "yes" if co["bitwise"] else "NO")
                ratio = ref["d2h_s"] / x["park_s"]
                goals.append(f"{gib:g} GiB cooperative park, {label}: {ratio:.2f}x pinned D2H "
                             f"(goal >= {PARK_GOAL}x): {'met' if ratio >= PARK_GOAL else 'NOT met'}")
        for prep in ((False, True) if "ahead" in parts else ()):
            label = f"cold park, asked one {a.ahead_s:g} s step ahead, " + ("prepared" if prep else "not prepared")
            x = run_child("ahead", nbytes, "1" if prep else "0", str(a.ahead_s))
            if "error" in x:
                t.add_row(f"{gib:g}", label, x["error"], "", "", "", "")
                continue
            t.add_row(f"{gib:g}", label, f"{x['park_s']:.3f}", gbs(x["park_s"]), f"{ref['d2h_s'] / x['park_s']:.2f}",
                      f"-> {x['nvml_parked'] / GIB:.2f} GiB", "yes" if x["bitwise"] else "NO")
            t.add_row(f"{gib:g}", "  request -> GPU memory free", f"{x['latency_s']:.3f}", "", "", "", "")
            t.add_row(f"{gib:g}", f"  step: plain {x['step_s']:.3f} s, with the pause asked",
                      f"{x['step_during_s']:.3f}", "", f"{x['step_during_s'] / x['step_s']:.2f}x plain", "", "")
            ratio = ref["d2h_s"] / x["park_s"]
            goals.append(f"{gib:g} GiB {label}: park {ratio:.2f}x pinned D2H (goal >= {PARK_GOAL}x): "
                         f"{'met' if ratio >= PARK_GOAL else 'NOT met'}; request -> free {x['latency_s']:.3f} s "
                         f"(step {x['step_during_s']:.3f} s); prefault {x['prefault']}")
        if "transparent" not in parts:
            continue
        if driver is None:
            t.add_row(f"{gib:g}", "transparent", f"n/a: {driver_note}", "", "", "", "")
            continue
        plain = run_transparent(script, nbytes, a.steps)
        r = run_transparent(script, nbytes, a.steps, driver)
        freeze, thaw = r["lock_s"] + r["checkpoint_s"], r["restore_s"] + r["unlock_s"]
        same = "yes" if r.get("hash") and r.get("hash") == plain.get("hash") else "NO"
        t.add_row(f"{gib:g}", "transparent freeze (lock+checkpoint)", f"{freeze:.3f}", gbs(freeze),
                  f"{ref['d2h_s'] / freeze:.2f}", f"{r['before'] / GIB:.2f} -> {r['frozen'] / GIB:.2f} GiB", "")
        t.add_row(f"{gib:g}", "transparent thaw (restore+unlock)", f"{thaw:.3f}", gbs(thaw),
                  f"{ref['h2d_s'] / thaw:.2f}", "", same)
        bps = nbytes / freeze
        goals.append(f"{gib:g} GiB transparent freeze: {bps / 1e9:.1f} GB/s = {bps / PUBLISHED_FREEZE_BPS:.1f}x "
                     f"cuda-checkpoint's published 2.7 GB/s (goal >= {FREEZE_GOAL}x): "
                     f"{'met' if bps >= FREEZE_GOAL * PUBLISHED_FREEZE_BPS else 'NOT met'}")
    console.print(t)
    if driver is not None:
        console.print(f"transparent path: {driver_note}")
    for g in goals:
        console.print(g)
    console.print("reference (published): cuda-checkpoint froze 3.6 GB in 1.3 s (2.7 GB/s), thawed in 0.83 s, H100 PCIe")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
