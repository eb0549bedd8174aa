"""A job whose one CUDA process holds memory on two GPUs, frozen and thawed by the real daemon on
the simulated device and driver: NVML lists the process on both GPUs (a context on each), the
freeze records both (pid, GPU) footprints and frees both GPUs, and the thaw waits until both have
room. The old simulation kept a process on the last GPU it allocated on, so the first GPU looked
empty and the thaw did not wait for it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gpuswap.protocol import rundir
from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES as CTX
from gpuswap_testing import Gate

GiB = 2**30

# Allocates 2 GiB on device 0 and 1 GiB on device 1, says so, then makes a CUDA call (which blocks
# while the driver holds it) before each line; held before its last line by a gate.
TWO_GPUS = """import os, sys, time
from gpuswap import simcuda
gate, ready = sys.argv[1], sys.argv[2]
simcuda.allocate(2 << 30, device=0)
simcuda.allocate(1 << 30, device=1)
open(ready, "w").close()
for i in range(1, 101):
    while i == 100 and not os.path.exists(gate):
        time.sleep(0.05)
    simcuda.sync()
    print(i, flush=True)
    time.sleep(0.01)
"""

FILL = """import sys, time
from gpuswap import simcuda
simcuda.allocate(int(sys.argv[1]))
open(sys.argv[2], "w").close()
time.sleep(3600)
"""


def _wait_file(daemon, job: int, path: Path) -> None:
    daemon.until(job, lambda j: path.exists() or j["state"] not in ("PENDING", "RUNNING"))
    assert path.exists(), daemon.job(job)


def _procs(daemon) -> list[list[dict]]:
    return [g["processes"] for g in daemon.client.get("/v1/gpus")["gpus"]]


def test_a_process_on_two_gpus_is_frozen_from_both_and_thawed_once_both_have_room(make_daemon, home):
    daemon = make_daemon("--simulate-gpus", "2x8GiB", "--min-runtime", "1")
    gate = Gate(home / "go")
    script, ready = home / "two_gpus.py", home / "ready"
    script.write_text(TWO_GPUS)
    job = daemon.submit(["sh", "-c", f"{sys.executable} {script} {gate.path} {ready}; echo end"],
                        name="wide", priority="low", gpus=2)
    _wait_file(daemon, job, ready)
    assert sorted(daemon.job(job)["assigned_gpus"]) == [0, 1]
    first, second = _procs(daemon)
    assert len(first) == 1 and first[0]["used_bytes"] == 2 * GiB + CTX        # a context on each GPU
    assert second == [{**first[0], "used_bytes": GiB + CTX}]
    pid = first[0]["pid"]

    assert daemon.cli("pause", str(job)).returncode == 0
    j = daemon.until(job, lambda j: j["state"] == "PAUSED")
    assert j["mechanism"] == "transparent" and j["parked_bytes"] == 3 * GiB + 2 * CTX
    record = json.loads((home / "jobs" / str(job) / "run-1" / rundir.TRANSPARENT).read_text())
    assert sorted((p["pid"], p["gpu"], p["nbytes"]) for p in record["processes"]) == \
        [(pid, 0, 2 * GiB + CTX), (pid, 1, GiB + CTX)]
    assert _procs(daemon) == [[], []]
    assert [g["mem_used"] for g in daemon.client.get("/v1/gpus")["gpus"]] == [0, 0]

    # Someone outside gpuswap takes 6 of GPU 0's 8 GiB: the second GPU has room, the first not.
    filled = home / "filled"
    env = dict(os.environ, GPUSWAP_SIM_CUDA_DIR=str(home / "simulated-driver"), CUDA_VISIBLE_DEVICES="0")
    filler = subprocess.Popen([sys.executable, "-c", FILL, str(6 * GiB - CTX), str(filled)], env=env)
    try:
        daemon.until(job, lambda j: filled.exists() or filler.poll() is not None)
        assert filled.exists()
        assert daemon.cli("resume", str(job)).returncode == 0
        j = daemon.until(job, lambda j: "waiting for room" in j["reason"] or j["state"] == "RUNNING")
        assert j["state"] == "RESUMING" and "GPU 0 has 2.0 GiB free" in j["reason"], j["reason"]
    finally:
        filler.send_signal(signal.SIGKILL)
        filler.wait()
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    assert _procs(daemon) == [first, second]                               # all of it back, on both
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0
