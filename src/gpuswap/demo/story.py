"""`gpuswap demo`: the product's story end to end, with its own daemon in a fresh directory
(inside $GPUSWAP_HOME when that is set, else in the system's temporary directory).

A long low-priority training job holds the GPU; an urgent job arrives; the long job is parked
at its next safepoint, the urgent job runs, the long job resumes and finishes with parameters
bitwise-equal to an uninterrupted run made first, outside gpuswap.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from rich.markup import escape

from gpuswap.api.client import Client, ClientError
from gpuswap.policy.model import PolicyConfig
from gpuswap.protocol import env as envvars
from gpuswap.terminal import console, state_text

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def real_gpu_count() -> int:
    """NVIDIA GPUs NVML sees here; 0 without a driver or library (then one simulates)."""
    try:
        from gpuswap.node.gpus import NvmlGpus

        return NvmlGpus().count
    except Exception:   # no driver, no library: simulate
        return 0


# The policy's defaults: a job that parks in a second is protected only a few seconds after it
# starts (cost-aware protection, docs/policies.md), so the urgent job gets the GPU in seconds.
DEMO_DAEMON_ARGS = ("--pause-timeout", "30")
STEP_TIME_S = 0.03          # the long job's sleep per step
# No job is paused within the policy's --min-runtime (5 s) of its start, whatever it costs to park:
# a long job that sleeps through its steps in less has always ended before the urgent job could
# take its GPU, and the story cannot happen (with a few more, it can, on a fast enough machine).
MIN_STEPS = math.floor(PolicyConfig().min_runtime_s / STEP_TIME_S) + 1


def steps_problem(steps: int) -> Optional[str]:
    """Why the story cannot happen with a long job of `steps` steps; None if it can."""
    if steps < MIN_STEPS:
        return (f"--steps {steps}: the long job needs at least {MIN_STEPS} ({STEP_TIME_S} s each) to outlast "
                f"the {PolicyConfig().min_runtime_s:g} s after its start in which no job is paused (--min-runtime)")
    return None


TOO_SHORT = "; it is too short on this machine: give it more --steps"


class NoStory(Exception):
    """The jobs ran, but not as the story goes (the long job ended before it was parked): one
    line, and the demo exits 1."""


def start_private_daemon(home: Path, simulate: Optional[str], args: tuple[str, ...] = DEMO_DAEMON_ARGS,
                         timeout: float = 30.0) -> subprocess.Popen:
    """A `gpuswap server` of its own on `home` (its socket, its database), never the machine's
    daemon; returns once it answers. Its output goes to home/daemon.log. It reads no config file
    but its fresh home's (none): never $GPUSWAP_CONFIG, which may be the machine daemon's."""
    argv = [sys.executable, "-m", "gpuswap.cli.main", "server", *args]
    if simulate:
        argv += ["--simulate-gpus", simulate]
    env = {k: v for k, v in os.environ.items() if k != envvars.CONFIG} | {envvars.HOME: str(home)}
    proc = subprocess.Popen(argv, env=env, stdout=open(home / "daemon.log", "ab"), stderr=subprocess.STDOUT)
    client = Client(home)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the private daemon exited: {(home / 'daemon.log').read_text()[-500:]}")
        try:
            client.get("/v1/health")
            return proc
        except ClientError:
            time.sleep(0.1)
    stop_daemon(proc)
    raise RuntimeError(f"the private daemon did not start within {timeout:.0f} s")


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Watch:
    """Prints each state change of the demo's jobs as it happens."""

    def __init__(self, client: Client, t0: float):
        self.client, self.t0, self.seen, self.jobs = client, t0, {}, {}

    def poll(self) -> dict[int, dict[str, Any]]:
        for j in self.client.get("/v1/jobs"):
            self.jobs[j["id"]] = j
            key = (j["state"], j.get("parked"))
            if self.seen.get(j["id"]) != key:
                self.seen[j["id"]] = key
                live = j.get("step") is not None and j["state"] not in TERMINAL
                step = f" step {j['step']}" if live else ""
                name, state = escape(f"{j['name']:<6}"), escape(f"{state_text(j):<40}")
                console.print(f"  {time.monotonic() - self.t0:6.1f}s  job {j['id']} [bold]{name}[/bold] "
                              f"{state}{step}  [dim]{escape(j['reason'])}[/dim]")
        return self.jobs

    def until(self, job_id: int, pred: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            j = self.poll()[job_id]
            if pred(j):
                return j
            time.sleep(0.2)
        raise RuntimeError(f"job {job_id} did not reach the expected state within {timeout:.0f} s")


def run_demo(keep: bool = False, steps: int = 400) -> int:
    base = Path(os.environ[envvars.HOME]).expanduser() if os.environ.get(envvars.HOME) else None
    try:   # the user chose where gpuswap state goes: a fresh directory there, beside any daemon's
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        home = Path(tempfile.mkdtemp(prefix="gpuswap-demo-", dir=base))
    except OSError as e:
        where = escape(str(base or tempfile.gettempdir()))
        console.print(f"[red]demo failed:[/red] cannot make its directory in {where} ({envvars.HOME}): "
                      f"{escape(e.strerror or str(e))}")
        return 1
    ngpus = real_gpu_count()
    simulate = None if ngpus else "1x80GiB"
    where = f"{ngpus} real GPU(s)" if ngpus else (
        "1 SIMULATED GPU (no real GPU here; memory figures are the simulated device's process list, "
        "where each job's process registers what it holds)")
    console.print(f"[bold]gpuswap demo[/bold] in {home}: {where}")
    train = [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps)]
    daemon: Optional[subprocess.Popen] = None
    try:
        console.print("1. reference: the training script run uninterrupted, outside gpuswap")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
        # On the device the job will use: on simulated GPUs jobs run with GPUSWAP_SIMULATED_GPU=1,
        # on the CPU even where torch sees CUDA (a machine whose NVML is missing).
        ref_env = dict(env, **{envvars.SIMULATED: "1"}) if simulate else env
        subprocess.run(train + ["--out", str(home / "reference.json")], env=ref_env, check=True,
                       stdout=subprocess.DEVNULL)
        reference = json.loads((home / "reference.json").read_text())
        console.print(f"   parameters sha256 {reference['sha256'][:16]}…")

        console.print("2. daemon started; a long low-priority job takes the GPU(s)")
        daemon = start_private_daemon(home, simulate)
        client = Client(home)
        t0 = time.monotonic()
        watch = Watch(client, t0)
        gpus = max(1, ngpus)
        long_id = client.post("/v1/jobs", {
            "argv": train + ["--step-time", str(STEP_TIME_S), "--out", str(home / "long.json")], "cwd": str(home),
            "env": env, "name": "long", "priority": "low", "gpus": gpus, "mem": "20GiB"})["id"]
        running = watch.until(long_id, lambda j: j["state"] in TERMINAL
                              or (j["state"] == "RUNNING" and (j.get("step") or 0) >= steps // 8), 120)
        if running["state"] in TERMINAL:
            raise NoStory(f"the long job ended {running['state']} before the urgent job came{TOO_SHORT}")

        console.print("3. an urgent job arrives")
        urgent_id = client.post("/v1/jobs", {
            "argv": [sys.executable, "-m", "gpuswap.demo.eval", "--seconds", "3"], "cwd": str(home),
            "env": env, "name": "urgent", "priority": "urgent", "gpus": 1})["id"]
        watch.until(urgent_id, lambda j: j["state"] != "PENDING", 120)
        urgent = watch.until(urgent_id, lambda j: j["state"] in TERMINAL, 120)
        long_job = watch.until(long_id, lambda j: j["state"] in TERMINAL, 600)

        ev_urgent = client.get(f"/v1/jobs/{urgent_id}")["events"]
        ev_long = client.get(f"/v1/jobs/{long_id}")["events"]
        waited, took, parked_for = timeline(ev_urgent, urgent["state"], ev_long, long_job["state"])
        parked = [e["reason"] for e in ev_long if e["state"] == "PAUSED"]
        try:
            result = json.loads((home / "long.json").read_text())
        except (OSError, ValueError):
            raise NoStory(f"the long job ended {long_job['state']} without writing its result") from None
        same = result["sha256"] == reference["sha256"]
        console.print("\n[bold]summary[/bold]")
        console.print(f"  urgent job waited {waited:.2f} s for a GPU (submit → running), "
                      f"ended {urgent['state']} ({urgent['exit_code']}); {took:.1f} s in all")
        console.print(f"  long job parked for {parked_for:.2f} s — {parked[0]}")
        console.print(f"  long job ended {long_job['state']} after {long_job['preemptions']} preemption(s); "
                      f"final parameters {'EQUAL' if same else 'DIFFERENT'} to the uninterrupted run "
                      f"(sha256 {result['sha256'][:16]}… vs {reference['sha256'][:16]}…)")
        if ngpus == 0:
            console.print("  (simulated GPU: the bytes parked are the job's real tensor bytes, held in CPU "
                          "memory; no GPU memory was involved)")
        ok = same and urgent["state"] == "COMPLETED" and long_job["state"] == "COMPLETED"
        return 0 if ok else 1
    except NoStory as e:
        console.print(f"[red]demo failed:[/red] the story could not be shown: {escape(str(e))}")
        return 1
    except (RuntimeError, ClientError, subprocess.CalledProcessError, KeyError) as e:
        console.print(f"[red]demo failed:[/red] {escape(str(e))}")
        return 1
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        if keep:
            console.print(f"  state kept in {home} (GPUSWAP_HOME={home} gpuswap ls)")
        else:
            shutil.rmtree(home, ignore_errors=True)


def timeline(ev_urgent: list[dict[str, Any]], urgent_state: str, ev_long: list[dict[str, Any]],
             long_state: str) -> tuple[float, float, float]:
    """(seconds the urgent job waited for a GPU, from its submission to its end, seconds the long
    job was parked), from the jobs' event logs; NoStory when the logs do not tell the story."""
    submitted, ran, ended = (_first(ev_urgent, s) for s in ("PENDING", "RUNNING", urgent_state))
    if submitted is None or ran is None or ended is None:
        raise NoStory(f"the urgent job never ran (it ended {urgent_state})")
    paused, resumed = _first(ev_long, "PAUSED"), _first(ev_long, "RESUMING")
    if paused is None:
        raise NoStory(f"the long job ended {long_state} before it was parked for the urgent job{TOO_SHORT}")
    if resumed is None:
        raise NoStory(f"the long job was parked, then ended {long_state} without resuming")
    return ran - submitted, ended - submitted, resumed - paused


def _first(events: list[dict[str, Any]], state: str) -> Optional[float]:
    """The time the job first entered `state`; None if it never did."""
    return next((float(e["time"]) for e in events if e["state"] == state), None)
