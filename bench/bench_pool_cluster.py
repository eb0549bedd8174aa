"""Benchmark an urgent job's start on a pool's remote node, and submits through a node's socket
(docs/ray.md), on a real Ray cluster.

    python bench/bench_pool_cluster.py [--rounds 5] [--step-time 0.1]

Starts a two-node `ray.cluster_utils.Cluster` on this machine (each node with one simulated GPU and
its own agent directory), a head daemon (`gpuswap server --ray ADDRESS`) and, for the reference, a
single daemon (`--simulate-gpus 1x80GiB`). The head's node's GPU is held by a job that may not be
paused, so every urgent job goes to the other node, through its agent (Ray calls). Measured: the
time from an urgent submit to its process writing the clock, with that node's GPU free, and with a
low-priority training job (safepoint every --step-time s) on it that must be parked first. The
reference is the same submit on the single daemon with its GPU free, in the same run. Then the
rate of submits through node-b's socket (its agent forwards each to the head, node/gateway.py)
against the head's own socket, every GPU held so the jobs wait. Wall times on
one machine's clock; the Ray nodes share this machine, so the network is the loopback.
Needs Ray (pip install "gpuswap[ray]").
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

from gpuswap.api.client import Client, ClientError
from gpuswap.protocol import env as envvars

from machine import machine  # bench/machine.py: python puts bench/ first on sys.path


class Server:
    """A `gpuswap server` process with its own state directory."""

    def __init__(self, home: Path, *args: str):
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if k != "GPUSWAP_CONFIG"}
        self.env.update(GPUSWAP_HOME=str(home))
        self.out = open(home / "daemon.out", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", *args],
                                     env=self.env, stdout=self.out, stderr=subprocess.STDOUT)
        self.client = Client(home, timeout=60)
        self.jobs: list[int] = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited: {(home / 'daemon.out').read_text()[-2000:]}")
            try:
                self.client.get("/v1/health")
                return
            except ClientError:
                time.sleep(0.1)
        raise RuntimeError("the daemon did not start")

    def submit(self, argv: list[str], **opts: object) -> int:
        job = int(self.client.post("/v1/jobs", {"argv": argv, "cwd": str(self.home), "env": self.env, **opts})["id"])
        self.jobs.append(job)
        return job

    def until(self, what: str, pred, timeout: float = 300, get: str = "/v1/health"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.client.get(get)
            if pred(got):
                return got
            time.sleep(0.05)
        raise RuntimeError(f"never: {what}")

    def job(self, job_id: int) -> dict:
        return self.client.get(f"/v1/jobs/{job_id}")

    def state(self, job_id: int, *states: str) -> dict:
        return self.until(f"job {job_id} in {states}", lambda j: j["state"] in states, get=f"/v1/jobs/{job_id}")

    def close(self) -> None:
        """Cancel what is still live (its processes end through their supervisors), then stop."""
        for j in self.jobs:
            try:
                if not self.job(j)["ended"]:
                    self.client.post(f"/v1/jobs/{j}/cancel")
                    self.state(j, "CANCELLED", "COMPLETED", "FAILED")
            except (ClientError, RuntimeError):
                pass
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()


def urgent_latency(d: Server, marker: Path) -> tuple[float, str]:
    marker.unlink(missing_ok=True)
    t0 = time.time()
    job = d.submit(["sh", "-c", f"date +%s.%N > {marker}"], name="urgent", priority="urgent")
    done = d.state(job, "COMPLETED", "FAILED")
    return float(marker.read_text()) - t0, str(done.get("node"))


def submit_rate(d: Server, client: Client, n: int) -> float:
    """Submits per second through `client` (the head's socket, or a node's forwarded by its agent)."""
    t0 = time.perf_counter()
    for _ in range(n):
        d.jobs.append(int(client.post("/v1/jobs", {"argv": ["true"], "cwd": str(d.home), "priority": "low",
                                                   "name": "throughput"})["id"]))
    return n / (time.perf_counter() - t0)


def node_args(base: Path, name: str) -> dict:
    return dict(num_cpus=1, object_store_memory=80 * 1024**2, include_dashboard=False,
                env_vars={envvars.AGENT_HOME: str(base / f"agent-{name}"), envvars.AGENT_SIMULATE_GPUS: "1x80GiB",
                          envvars.NODE_NAME: name})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--submits", type=int, default=100, help="submits timed through each socket")
    a = ap.parse_args()
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        print('bench_pool_cluster: needs Ray (pip install "gpuswap[ray]")', file=sys.stderr)
        return 69
    base = Path(tempfile.mkdtemp(prefix="gsbp-", dir="/tmp"))
    base.chmod(0o755)
    marker = base / "started"
    cluster = head = single = None
    try:
        (base / "single").mkdir()
        single = Server(base / "single", "--simulate-gpus", "1x80GiB", "--no-calibrate")
        free_ref = [urgent_latency(single, marker)[0] for _ in range(a.rounds)]
        single.close()
        single = None

        cluster = Cluster(initialize_head=True, head_node_args=node_args(base, "node-a"))
        cluster.add_node(**node_args(base, "node-b"))
        cluster.wait_for_nodes()
        (base / "head").mkdir()
        head = Server(base / "head", "--ray", cluster.address, "--no-calibrate", "--min-runtime", "0",
                      "--protect-multiple", "0", "--max-switch-fraction", "1")
        head.until("both nodes' GPUs", lambda g: sorted(x["node"] for x in g["gpus"]) == ["node-a", "node-b"],
                   get="/v1/gpus")
        keep = head.submit(["sleep", "3600"], name="keep", preemptible=False)    # holds one node's GPU
        held_on = head.state(keep, "RUNNING")["node"]
        remote = [urgent_latency(head, marker) for _ in range(a.rounds)]
        busy, parks = [], []
        for _ in range(a.rounds):
            long_job = head.submit([sys.executable, "-m", "gpuswap.demo.train", "--steps", "100000",
                                    "--step-time", str(a.step_time)], name="long", priority="low")
            head.until("the long job past step 5", lambda j: j["state"] == "RUNNING" and (j["step"] or 0) > 5,
                       get=f"/v1/jobs/{long_job}")
            busy.append(urgent_latency(head, marker))
            parked = [e["reason"] for e in head.job(long_job)["events"] if e["kind"] == "parked_ram"]
            parks.append(float(parked[0].rsplit(" in ", 1)[1].split()[0]) if parked else float("nan"))
            head.client.post(f"/v1/jobs/{long_job}/cancel")
            head.state(long_job, "CANCELLED")
        nodes = {n for _, n in remote + busy}
        # Submit throughput: every GPU held by a job that may not be paused, so the low jobs
        # submitted wait (they are cancelled at the end); one client, one submit after another.
        head.submit(["sleep", "3600"], name="keep-2", preemptible=False)
        head.until("both GPUs held", lambda g: all(x["jobs"] for x in g["gpus"]), get="/v1/gpus")
        node_client = Client(base / "agent-node-b", timeout=60)
        via_head = submit_rate(head, head.client, a.submits)
        via_node = submit_rate(head, node_client, a.submits)
    finally:
        for s in (single, head):
            if s is not None:
                s.close()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)

    from rich.console import Console
    from rich.table import Table

    ref = statistics.median(free_ref)
    free = statistics.median(t for t, _ in remote)
    lat = statistics.median(t for t, _ in busy)
    park = statistics.median(parks)
    goal = a.step_time + park + 1.0
    t = Table(title=(f"urgent submit -> process start on a pool's remote node, median of {a.rounds}\n{machine()}, "
                     f"load average {os.getloadavg()[0]:.1f}; the head's node ({held_on}) held, the jobs ran on "
                     f"{', '.join(sorted(nodes))}; reference: one machine, GPU free, {ref:.2f} s"))
    for col in ("measure", "seconds", "x reference", "goal", "met"):
        t.add_column(col)
    t.add_row("remote node, GPU free", f"{free:.2f}", f"{free / ref:.1f}", "", "")
    t.add_row("remote node, low job parked first", f"{lat:.2f}", f"{lat / ref:.1f}",
              f"<= {goal:.2f} (safepoint {a.step_time} + park {park:.2f} + 1)", "yes" if lat <= goal else "no")
    Console(width=160).print(t)
    t = Table(title=f"submit throughput, {a.submits} submits one after another from one client (jobs/s); "
                    "reference: the head's own socket")
    for col in ("socket", "submits/s", "x reference"):
        t.add_column(col)
    t.add_row("the head's (gpuswap server --ray)", f"{via_head:.1f}", "1.0")
    t.add_row("node-b's agent (forwarded to the head)", f"{via_node:.1f}", f"{via_node / via_head:.2f}")
    Console(width=160).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
