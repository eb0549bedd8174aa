"""Plain values given to `attach` (`epoch=3`) behave the same under the daemon as outside it:
kept in `job.state` under their name, restored there from a disk checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

# argv: steps, step time, and optionally a gate file: the job holds at its safepoints from step
# steps - 2 on until the test creates it (so it cannot end before the test's pause reaches it).
SCRIPT = """
import json, os, sys, time, gpuswap
job = gpuswap.attach(epoch=3, tag="run-a")
print("START", json.dumps({"step": job.start_step, "epoch": job.state["epoch"], "tag": job.state["tag"]}),
      flush=True)
try:
    gpuswap.attach(thing=object())
except TypeError as e:
    print("REFUSED", e, flush=True)
for step in range(job.start_step, int(sys.argv[1])):
    job.state["epoch"] = 100 + step
    time.sleep(float(sys.argv[2]))
    job.safepoint(step)
    while len(sys.argv) > 3 and step >= int(sys.argv[1]) - 2 and not os.path.exists(sys.argv[3]):
        time.sleep(0.02)
        job.safepoint(step)
print("END", job.state["epoch"], flush=True)
"""


def _lines(text: str, tag: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in text.splitlines() if line.startswith(tag + " ")]


def test_plain_values_inside_and_outside_and_restored_from_disk(daemon):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    outside = subprocess.run([sys.executable, "-c", SCRIPT, "3", "0"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert outside.returncode == 0, outside.stderr

    gate = daemon.home / "go"
    job = daemon.submit([sys.executable, "-c", SCRIPT, "40", "0.1", str(gate)], name="plain")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j["step"] or 0) >= 5)
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0
    parked = daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert daemon.cli("resume", str(job)).returncode == 0
    gate.touch()
    daemon.state(job, "COMPLETED", timeout=60)
    log = daemon.cli("logs", str(job)).stdout

    starts = [json.loads(s) for s in _lines(log, "START")]
    assert starts[0] == json.loads(_lines(outside.stdout, "START")[0]) == {"step": 0, "epoch": 3, "tag": "run-a"}
    step = parked["step"]
    assert starts[1] == {"step": step + 1, "epoch": 100 + step, "tag": "run-a"}   # restored, not 3
    assert _lines(log, "REFUSED")[0] == _lines(outside.stdout, "REFUSED")[0]     # same refusal both ways
    assert _lines(log, "END") == ["139"] and _lines(outside.stdout, "END") == ["102"]
