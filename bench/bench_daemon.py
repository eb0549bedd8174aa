"""Daemon benchmarks: submit throughput and urgent-job start latency, against references measured
in the same run. Prints a table with the machine.

    python bench/bench_daemon.py [--jobs 2000] [--clients 8] [--rounds 5]

- submit throughput: jobs/s acknowledged (durable in SQLite) by concurrent clients while the one
  GPU is held, so every job stays queued. Reference: GET /v1/health on the same socket and
  clients (the HTTP stack's ceiling). Goal: >= 500 jobs/s on 2 cores.
- urgent latency: time from an urgent submit to its process starting while a low-priority
  training job (safepoint every --step-time s) holds the GPU. Reference: the same submit with the
  GPU free. Goal: <= safepoint interval + parking time + 1 s.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpuswap.api.client import Client, ClientError

from machine import machine  # bench/machine.py: python puts bench/ first on sys.path

ROOT = Path(__file__).resolve().parent.parent




class BenchDaemon:
    def __init__(self, *args: str):
        self.home = Path(tempfile.mkdtemp(prefix="gsb-", dir="/tmp"))
        self.env = dict(os.environ, GPUSWAP_HOME=str(self.home))
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", *args],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = Client(self.home)
        for _ in range(300):
            try:
                self.client.get("/v1/health")
                return
            except ClientError:
                time.sleep(0.05)
        raise RuntimeError("daemon did not start")

    def submit(self, argv: list[str], client: Client | None = None, **opts: object) -> int:
        body = {"argv": argv, "cwd": str(self.home), "env": self.env, **opts}
        return (client or self.client).post("/v1/jobs", body)["id"]

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            j = self.client.get(f"/v1/jobs/{job_id}")
            if j["state"] in states:
                return j
            time.sleep(0.05)
        raise RuntimeError(f"job {job_id} never reached {states}")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        subprocess.run(["pkill", "-9", "-f", str(self.home)], check=False)
        shutil.rmtree(self.home, ignore_errors=True)


def rate(n_total: int, clients: int, call) -> float:
    per = n_total // clients
    barrier = threading.Barrier(clients + 1)

    def worker() -> None:
        c = Client(bench.home)
        barrier.wait()
        for _ in range(per):
            call(c)
        c.close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return per * clients / (time.perf_counter() - t0)


def urgent_latency(d: BenchDaemon, marker: Path) -> float:
    marker.unlink(missing_ok=True)
    t0 = time.time()
    job = d.submit(["sh", "-c", f"date +%s.%N > {marker}"], name="urgent", priority="urgent")
    d.wait_state(job, ("COMPLETED", "FAILED"))
    return float(marker.read_text()) - t0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-time", type=float, default=0.1)
    a = ap.parse_args()
    console = Console()
    rows = []

    # -- submit throughput ------------------------------------------------------------------
    bench = BenchDaemon("--simulate-gpus", "1x80GiB")
    holder = bench.submit(["sleep", "600"], name="holder", preemptible=False)
    bench.wait_state(holder, ("RUNNING",))
    health = rate(a.jobs, a.clients, lambda c: c.get("/v1/health"))
    submits = rate(a.jobs, a.clients, lambda c: bench.submit(["true"], client=c, priority="low"))
    queued = len(bench.client.get("/v1/jobs"))
    bench.close()
    rows.append(("submit throughput (durable, queued)", f"{submits:.0f} jobs/s",
                 f"GET /v1/health {health:.0f} req/s", f"{submits / health:.2f}", ">= 500 jobs/s",
                 "yes" if submits >= 500 else "NO"))

    # -- urgent start latency -----------------------------------------------------------------
    bench = BenchDaemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--protect-multiple", "0")
    marker = bench.home / "started"
    free = statistics.median(urgent_latency(bench, marker) for _ in range(a.rounds))
    busy, parks = [], []
    for r in range(a.rounds):
        long_job = bench.submit([sys.executable, "-m", "gpuswap.demo.train", "--steps", "100000",
                                 "--step-time", str(a.step_time)], name="long", priority="low")
        bench.wait_state(long_job, ("RUNNING",))
        while not (bench.client.get(f"/v1/jobs/{long_job}").get("step") or 0) > 5:
            time.sleep(0.1)
        busy.append(urgent_latency(bench, marker))
        j = bench.client.get(f"/v1/jobs/{long_job}")
        parked = [e["reason"] for e in j["events"] if e["state"] == "PAUSED"]
        parks.append(float(parked[0].rsplit(" in ", 1)[1].split()[0]) if parked else float("nan"))
        bench.client.post(f"/v1/jobs/{long_job}/cancel")
        bench.wait_state(long_job, ("CANCELLED",))
    bench.close()
    lat = statistics.median(busy)
    goal = a.step_time + statistics.median(parks) + 1.0
    rows.append(("urgent submit -> process start, GPU busy", f"{lat:.2f} s (median of {a.rounds})",
                 f"GPU free {free:.2f} s", f"{lat / free:.1f}", f"<= {goal:.2f} s", "yes" if lat <= goal else "NO"))

    t = Table(title=f"gpuswap daemon benchmarks — {machine()}")
    for col in ("measure", "gpuswap", "reference (same run)", "ratio", "goal", "met"):
        t.add_column(col)
    for row in rows:
        t.add_row(*row)
    console.print(t)
    console.print(f"queued jobs after the submit run: {queued}; safepoint interval {a.step_time} s; "
                  f"parking times {', '.join(f'{p:.2f}' for p in parks)} s (simulated GPU)")
