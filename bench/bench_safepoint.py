"""Benchmark the runtime's costs: `safepoint` with nothing asked, and a simulated-GPU park/resume.

    python bench/bench_safepoint.py [--calls 2000000] [--sim-gib 1]

safepoint is timed for the handle inside gpuswap (with a live control channel: a tiny listening
socket in this process stands in for the supervisor) and for the no-op handle outside gpuswap,
next to an empty Python method call measured in the same run. The park/resume part runs the
runtime's parking code on CPU tensors (a simulated GPU), first park and later ones, next to a
plain copy of the same bytes. Parking real GPU memory at 4 and 16 GiB, against a pinned copy of
the same bytes: bench/bench_parking.py.
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

from machine import cpu_model  # bench/machine.py: python puts bench/ first on sys.path

GIB = 1 << 30




def listen_and_drain(address: str) -> socket.socket:
    """A stand-in supervisor: accept connections and read (and drop) everything sent."""
    from gpuswap.protocol.channel import socket_address

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


def _chunks(total: int) -> list:
    import torch

    chunk = min(total, 256 << 20)
    return [torch.ones(chunk // 4, dtype=torch.float32) for _ in range(total // chunk)]


def bench_sim_park(total: int, repeats: int) -> dict[str, float]:
    """Simulated-GPU park/resume of `total` bytes through the runtime's parking code: the first
    park (host pool cold: buffers mapped and first touched inside it), the best later one (pool
    warm), and a copy of the same bytes through one already-touched buffer as the reference."""
    from gpuswap.runtime import parking, pinned

    tensors = _chunks(total)
    pool = pinned.HostPool(None, keep_s=3600)
    out = {"cold_park_s": 0.0, "park_s": float("inf"), "resume_s": float("inf"), "copy_s": float("inf")}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        park = parking.copy_to_host(tensors, simulated=True, pool=pool)
        parking.release(park, simulated=True)
        t1 = time.perf_counter()
        parking.restore(park, simulated=True)
        parking.drop_host(park)
        t2 = time.perf_counter()
        if i == 0:
            out["cold_park_s"] = t1 - t0
        else:
            out["park_s"] = min(out["park_s"], t1 - t0)
        out["resume_s"] = min(out["resume_s"], t2 - t1)
    import torch

    host = torch.zeros(total, dtype=torch.uint8)
    for _ in range(repeats):
        t0 = time.perf_counter()
        off = 0
        for t in tensors:
            v = t.view(torch.uint8)
            host[off:off + v.numel()].copy_(v)
            off += v.numel()
        out["copy_s"] = min(out["copy_s"], time.perf_counter() - t0)
    pool.release_idle()
    pool.wait_released()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--sim-gib", type=float, default=1.0, help="GiB for the simulated park/resume")
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
    print("park/resume on a GPU (against a pinned copy of the same bytes): bench/bench_parking.py")
    print(f"simulated GPU, {args.sim_gib:g} GiB (CPU tensors, pageable host buffers from the runtime's pool):")
    total = int(args.sim_gib * GIB)
    r = bench_sim_park(total, repeats=args.repeats)
    gb = total / 1e9
    print(f"{'first park s':>13} {'GB/s':>6} {'park s':>7} {'GB/s':>6} {'resume s':>9} {'GB/s':>6} "
          f"{'copy GB/s':>10}")
    print(f"{r['cold_park_s']:13.3f} {gb / r['cold_park_s']:6.2f} {r['park_s']:7.3f} {gb / r['park_s']:6.2f} "
          f"{r['resume_s']:9.3f} {gb / r['resume_s']:6.2f} {gb / r['copy_s']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
