"""Benchmark the runtime's costs: `safepoint` with nothing asked, and park/resume throughput.

    python bench/bench_safepoint.py [--calls 2000000] [--sizes 4,16] [--sim-gib 1]

safepoint is timed for the handle inside gpuswap (with a live control channel: a tiny listening
socket in this process stands in for the supervisor) and for the no-op handle outside gpuswap,
next to an empty Python method call measured in the same run. Park/resume is timed on CUDA for
the given sizes against a plain pinned copy of the same bytes; without CUDA it says so and
times a simulated-GPU park/resume instead.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import threading
import time
import uuid

GIB = 1 << 30


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def listen_and_drain(address: str) -> socket.socket:
    """A stand-in supervisor: accept connections and read (and drop) everything sent."""
    from gpuswap.runtime.channel import socket_address

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(socket_address(address))
    srv.listen(1)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [None for _ in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv


class Reference:
    def noop(self, step: int) -> None:
        pass


def ns_per_call(fns: list, calls: int, rounds: int = 7) -> list[float]:
    """Best over `rounds` of `for i in range(calls): fn(i)` (loop overhead included). The
    functions take turns within each round so that load from other processes hits all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter_ns()
            for i in range(calls):
                fn(i)
            best[k] = min(best[k], (time.perf_counter_ns() - t0) / calls)
    return best


def bench_safepoint(calls: int) -> list[tuple[str, float]]:
    import torch

    import gpuswap
    from gpuswap.runtime import NullJob

    address = f"@gpuswap-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    srv = listen_and_drain(address)
    os.environ.update(GPUSWAP_JOB_ID="bench", GPUSWAP_CONTROL=address)
    os.environ.setdefault("GPUSWAP_SIMULATED_GPU", "0" if torch.cuda.is_available() else "1")
    model = torch.nn.Linear(64, 64)
    job = gpuswap.attach(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert job._client is not None and job._client.connected, "control channel did not connect"
    names = ["empty method call (reference)", "safepoint, inside gpuswap, channel live",
             "safepoint, outside gpuswap (no-op)"]
    fns = [Reference().noop, job.safepoint, NullJob().safepoint]
    rows = list(zip(names, ns_per_call(fns, calls)))
    job.close()
    srv.close()
    for k in ("GPUSWAP_JOB_ID", "GPUSWAP_CONTROL"):
        os.environ.pop(k, None)
    return rows


def _chunks(total: int, device: str):
    import torch

    chunk = min(total, 256 << 20)
    return [torch.ones(chunk // 4, dtype=torch.float32, device=device) for _ in range(total // chunk)]


def bench_park(total: int, simulated: bool, repeats: int) -> dict[str, float]:
    """Best seconds to park (copy out + free) and unpark `total` bytes, and to copy the same
    bytes through one preallocated host buffer (pinned on CUDA) as the reference."""
    import torch

    from gpuswap.runtime import parking

    device = "cpu" if simulated else "cuda"
    tensors = _chunks(total, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = {"park_s": float("inf"), "resume_s": float("inf"),
            "copy_out_s": float("inf"), "copy_in_s": float("inf")}

    def keep(key: str, seconds: float) -> None:
        best[key] = min(best[key], seconds)

    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        park = parking.copy_to_host(tensors, simulated)
        parking.release(park, simulated)
        t1 = time.perf_counter()
        parking.restore(park, simulated)
        t2 = time.perf_counter()
        parking.drop_host(park)
        keep("park_s", t1 - t0)
        keep("resume_s", t2 - t1)
    host = torch.zeros(total, dtype=torch.uint8, pin_memory=not simulated)
    views = [t.view(torch.uint8) for t in tensors]
    for _ in range(repeats):
        for key, out in (("copy_out_s", True), ("copy_in_s", False)):
            sync()
            t0 = time.perf_counter()
            off = 0
            for v in views:
                dst, src = (host[off:off + v.numel()], v) if out else (v, host[off:off + v.numel()])
                dst.copy_(src, non_blocking=True)
                off += v.numel()
            sync()
            keep(key, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--sizes", default="4,16", help="GiB sizes for the CUDA park/resume part")
    ap.add_argument("--sim-gib", type=float, default=1.0, help="GiB for the simulated part (no CUDA)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    import torch

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}; "
          f"torch {torch.__version__}; CUDA: "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    print()
    rows = bench_safepoint(args.calls)
    ref = rows[0][1]
    print(f"{'call (loop overhead included)':42} {'ns/call':>9} {'x reference':>12}")
    for name, ns in rows:
        print(f"{name:42} {ns:9.1f} {ns / ref:12.2f}")
    print()
    if torch.cuda.is_available():
        sizes = [(float(s), False) for s in args.sizes.split(",")]
        print("park/resume on CUDA (pinned host buffers), vs one plain pinned copy of the same bytes")
    else:
        print("park/resume of CUDA memory needs a GPU: not measured here. Simulated GPU instead:")
        sizes = [(args.sim_gib, True)]
    print(f"{'GiB':>5} {'park s':>8} {'GB/s':>7} {'resume s':>9} {'GB/s':>7} "
          f"{'copy-out GB/s':>14} {'copy-in GB/s':>13}")
    for gib, simulated in sizes:
        total = int(gib * GIB)
        r = bench_park(total, simulated, repeats=args.repeats)
        gb = total / 1e9
        print(f"{gib:5g} {r['park_s']:8.3f} {gb / r['park_s']:7.2f} {r['resume_s']:9.3f} "
              f"{gb / r['resume_s']:7.2f} {gb / r['copy_out_s']:14.2f} {gb / r['copy_in_s']:13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
