"""Multi-rank RAM parking under a real daemon: pause request -> every rank parked, and resume
request -> every rank training again, for torchrun DDP jobs of 2 and 4 ranks against a
single-process job (the reference) measured in the same run. Prints a table with the machine.

    python bench/bench_multirank.py [--reps 5] [--hidden 1024] [--ranks 2,4]

Each job trains the same MLP (two Linear layers of HIDDEN x 4*HIDDEN, AdamW; at the default
1024, 33.6 MB of parameters and 134 MB of parameters, gradients and optimizer state per rank)
with `gpuswap.attach` and `job.safepoint(step)`; the 2- and 4-rank jobs are DDP over gloo under
`torchrun --standalone`, the reference is the same script run as one plain process. The daemon
runs on simulated GPUs (`--simulate-gpus`), as the tests do: the figures are the daemon's own.

- daemon (the first two timing columns): the time between two events the daemon records, from
  the user's request ("pause to ram requested", "resume requested") to the state change it
  observed in the supervisor's status.json ("parked in RAM": every rank parked; "resumed from
  RAM": every rank has its memory back, its group made again and is past its safepoint). It
  includes the daemon's and the supervisor's polling (0.2 s controller tick, 0.05 s supervisor
  poll) and the wait for every rank's next safepoint (one step).
- supervisor (the next two): multi-rank, the coordinator's `pause_s` (pause sent to every rank ->
  every rank parked, the agreement included) and `resume_s` (resume sent -> every rank
  regrouped); single rank, the runtime's own `pause_s`/`resume_s` (the park and the restore at
  the safepoint, without the wait for it). Read from status.json once the daemon saw the state.

What is simulated: the "device" is CPU memory; a park copies every storage into host buffers
(memcpy) and resizes it to 0 bytes, a resume copies it back: no PCIe, no pinned-memory DMA.
The group rebuild measured is gloo's on loopback; NCCL's communicator teardown and rebuild (on a
GPU: seconds for 8 ranks, design open question 3) is not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gpuswap.api.client import Client, ClientError  # noqa: E402
from bench_daemon import machine as daemon_machine  # noqa: E402  (bench/ is on sys.path: run as a script)

# The job: trains until STOP exists; a safepoint every step. One process (the reference) or a
# torchrun rank (DDP over gloo). At the end it prints its median step time.
JOB = r'''
import os, statistics, sys, time
import torch
import torch.distributed as dist
from torch import nn
import gpuswap

stop, hidden = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
if multi:
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.ReLU(), nn.Linear(4 * hidden, hidden))
if multi:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
job = gpuswap.attach(model=model, optimizer=opt)
x = torch.randn(8, hidden)
times, step = [], 0
while True:
    t0 = time.perf_counter()
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    times.append(time.perf_counter() - t0)
    job.safepoint(step)
    step += 1
    done = torch.tensor([int(os.path.exists(stop))])
    if multi:
        dist.all_reduce(done, op=dist.ReduceOp.MAX)   # every rank leaves at the same step
    if done.item():
        break
job.close()
os.write(1, f"step_s {statistics.median(times):.4f}\n".encode())   # one write: ranks share the log
if multi:
    dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)   # gloo's destructors can deadlock at interpreter exit (pytorch#56297)
'''


def machine() -> str:
    """bench_daemon's machine line (CPU, cores, Python), plus the load at start and torch."""
    import torch

    return f"{daemon_machine()} (load {os.getloadavg()[0]:.1f} at start), torch {torch.__version__}"


class BenchDaemon:
    def __init__(self, gpus: int):
        self.home = Path(tempfile.mkdtemp(prefix="gsmr-", dir="/tmp"))
        self.env = dict(os.environ, GPUSWAP_HOME=str(self.home),
                        PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log = open(self.home / "daemon.out", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus",
                                      f"{gpus}x80GiB", "--min-runtime", "0", "--protect-multiple", "0", "--max-switch-fraction", "1",
                                      "--no-calibrate", "--pause-timeout", "300"],
                                     env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        self.client = Client(self.home, timeout=60)
        self.until_true("the daemon answers", self._healthy, 180)

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError((self.home / "daemon.out").read_text()[-3000:])
        try:
            self.client.get("/v1/health")
            return True
        except ClientError:
            return False

    @staticmethod
    def until_true(what: str, fact: Callable[[], Any], timeout: float = 600) -> Any:
        """Poll a fact; the deadline only catches one that never comes."""
        deadline = time.monotonic() + timeout
        while True:
            got = fact()
            if got:
                return got
            if time.monotonic() > deadline:
                raise RuntimeError(f"never happened: {what}")
            time.sleep(0.05)

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client.get(f"/v1/jobs/{job_id}")

    def until(self, job_id: int, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        def check() -> Any:
            j = self.job(job_id)
            if j["state"] in ("FAILED", "COMPLETED", "CANCELLED") and not pred(j):
                raise RuntimeError(f"job {job_id} ended: {j['events'][-1]['reason']}")
            return j if pred(j) else None
        return self.until_true(f"job {job_id}: {what}", check)

    def status(self, job_id: int) -> dict[str, Any]:
        return json.loads((self.home / "jobs" / str(job_id) / "run-1" / "status.json").read_text())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)


def event_time(j: dict[str, Any], prefix: str, nth: int) -> float:
    """When the daemon recorded the nth (1-based) event whose reason starts with `prefix`."""
    times = [e["time"] for e in j["events"] if e["reason"].startswith(prefix)]
    return float(times[nth - 1])


def measure(d: BenchDaemon, script: Path, ranks: int, reps: int, hidden: int) -> dict[str, Any]:
    stop = d.home / f"stop-{ranks}"
    cmd = [sys.executable, str(script), str(stop), str(hidden)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               *cmd[1:]]
    job = d.client.post("/v1/jobs", {"argv": cmd, "cwd": str(d.home), "env": d.env, "name": f"r{ranks}",
                                     "gpus": ranks, "pause_mode": "cooperative"})["id"]
    # Attached (every rank, for torchrun) and a few steps in: the first steps warm up gloo.
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j.get("step") or 0) >= 3
            and (ranks == 1 or len(j["ranks"]) == ranks), "attached and training")
    out: dict[str, Any] = {"pause": [], "resume": [], "pause_s": [], "resume_s": [], "bytes": 0}
    for n in range(1, reps + 1):
        d.client.post(f"/v1/jobs/{job}/pause", {"to": "ram"})
        j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram", "parked in RAM")
        out["pause"].append(event_time(j, "parked in RAM", n) - event_time(j, "pause to ram requested", n))
        rt = d.status(job)["runtime"]
        out["pause_s"].append(float(rt["pause_s"]))
        out["bytes"] = j["parked_bytes"]
        d.client.post(f"/v1/jobs/{job}/resume")
        j = d.until(job, lambda j: j["state"] == "RUNNING"
                    and sum(e["reason"].startswith("resumed from RAM") for e in j["events"]) == n, "resumed")
        out["resume"].append(event_time(j, "resumed from RAM", n) - event_time(j, "resume requested", n))
        out["resume_s"].append(float(d.status(job)["runtime"]["resume_s"]))
        # Stepping again before the next pause: the job's step has moved past the resume.
        step = j.get("step") or 0
        d.until(job, lambda j: (j.get("step") or 0) > step, "training after the resume")
    stop.touch()
    j = d.until(job, lambda j: j["state"] in ("COMPLETED", "FAILED"), "ended")
    if j["state"] != "COMPLETED":
        raise RuntimeError(f"{ranks}-rank job: {j['events'][-1]['reason']}")
    log = (d.home / "jobs" / str(job) / "output.log").read_text()
    steps = [float(x) for x in re.findall(r"step_s ([0-9.]+)", log)]
    out["step_s"] = statistics.median(steps) if steps else float("nan")
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5, help="pause/resume cycles per job (default 5)")
    ap.add_argument("--hidden", type=int, default=1024, help="MLP width (default 1024: 134 MB parked per rank)")
    ap.add_argument("--ranks", default="2,4", help="world sizes besides the 1-rank reference (default 2,4)")
    a = ap.parse_args()
    console = Console(width=200)   # the table's full width, also when piped into a file
    widths = [1] + [int(r) for r in a.ranks.split(",")]
    script = Path(tempfile.mkdtemp(prefix="gsmr-job-")) / "bench_job.py"
    script.write_text(JOB)
    about = machine()
    d = BenchDaemon(max(widths))
    results: dict[int, dict[str, Any]] = {}
    try:
        for n in widths:
            results[n] = measure(d, script, n, a.reps, a.hidden)
    finally:
        d.close()
        shutil.rmtree(script.parent, ignore_errors=True)
    ref = results[1]
    t = Table(title=f"multi-rank RAM park and resume under the daemon (simulated GPUs) - {about}")
    for col in ("ranks", "parked/rank", "step", "pause -> all parked (daemon)", "vs 1",
                "resume -> all training (daemon)", "vs 1", "pause_s (supervisor)", "resume_s (supervisor)"):
        t.add_column(col)
    for n, r in results.items():
        t.add_row("1 (plain process, reference)" if n == 1 else f"{n} (torchrun, DDP, gloo)",
                  f"{r['bytes'] / n / 1e6:.0f} MB", f"{r['step_s']:.3f} s",
                  spread(r["pause"]), f"{statistics.median(r['pause']) / statistics.median(ref['pause']):.2f}",
                  spread(r["resume"]), f"{statistics.median(r['resume']) / statistics.median(ref['resume']):.2f}",
                  spread(r["pause_s"]), spread(r["resume_s"]))
    console.print(t)
    console.print(f"seconds: median (min-max) of {a.reps} pause/resume cycles per job, all in one run. Simulated: "
                  "the device is CPU memory, a park is a memcpy to host buffers (no PCIe); the group "
                  "rebuild is gloo's on loopback, NCCL's communicator rebuild is not measured here. "
                  "Supervisor columns: multi-rank, the coordinator's (pause sent -> every rank parked, "
                  "agreement included; resume sent -> every rank regrouped); 1 rank, the runtime's park "
                  "and restore alone.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
