"""Issue 10 measurement: how fast /v1/gpus, GET /v1/jobs and /v1/overview answer with many
finished jobs (some with argv at the 256 KiB limit) and a few live ones with big argv.

    PYTHONPATH=src python bench/bench_limits.py --finished 3000 --big 200 --live 6

Builds the state database with whichever gpuswap is importable (so it also measures an older
checkout), starts a real daemon on it, times each endpoint (median of 15), and prints the
daemon's RSS and the database size.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from gpuswap.node.store import NewJob, Store


def build(home: Path, finished: int, big: int, live: int) -> None:
    store = Store(home / "state.db")
    now = time.time()
    env = {"PATH": "/usr/bin:/bin", **{f"VAR{i}": "v" * 40 for i in range(60)}}     # ~3 KiB, typical
    arg = "x" * (120 * 1024)
    small = [NewJob(f"small{i}", "root", 0, 0, ["python", "train.py", f"--seed={i}"], str(home), env, 0, 1, 0)
             for i in range(finished)]
    large = [NewJob(f"big{i}", "root", 0, 0, ["sh", "-c", "true", "sh", arg, arg], str(home), env, 0, 1, 0)
             for i in range(big)]
    for chunk in range(0, len(small), 500):
        store.add_jobs(small[chunk:chunk + 500], now)
    store.add_jobs(large, now)
    store._db.execute("UPDATE jobs SET state='COMPLETED', end_time=?, exit_code=0", (now,))
    store.add_jobs([NewJob(f"live{i}", "root", 0, 0, ["sh", "-c", "sleep 600", "sh", arg, arg], str(home), env, 0, 1, 0)
                    for i in range(live)], now)
    store.close()


def timed(c: httpx.Client, path: str, **params: str) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(15):
        t0 = time.perf_counter()
        r = c.get(path, params=params)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        size = len(r.content)
    return statistics.median(times), size


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--finished", type=int, default=3000)
    p.add_argument("--big", type=int, default=200)
    p.add_argument("--live", type=int, default=6)
    a = p.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gs-bench-", dir="/tmp"))
    try:
        build(home, a.finished, a.big, a.live)
        env = dict(os.environ, GPUSWAP_HOME=str(home))
        proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1x80GiB"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        c = httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")), base_url="http://x",
                         timeout=120)
        deadline = time.monotonic() + 60
        while True:
            try:
                c.get("/v1/health")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        time.sleep(3)   # the first ticks start a live job
        print(f"jobs: {a.finished} finished small, {a.big} finished with 240 KiB argv, {a.live} live with 240 KiB argv")
        for path, params in (("/v1/gpus", {}), ("/v1/jobs", {}), ("/v1/overview", {}), ("/v1/jobs/1", {})):
            t, size = timed(c, path, **params)
            print(f"  GET {path:<14} median {t * 1000:8.1f} ms  {size / 1024:10.0f} KiB")
        db = sum(f.stat().st_size for f in home.glob("state.db*"))
        print(f"  daemon RSS {psutil.Process(proc.pid).memory_info().rss / 2**20:.0f} MiB; state.db* {db / 2**20:.0f} MiB")
        proc.terminate()
        proc.wait(10)
    finally:
        subprocess.run(["pkill", "-9", "-f", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
