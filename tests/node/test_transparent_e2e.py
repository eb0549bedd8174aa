"""Unmodified jobs (no gpuswap import) parked through the driver checkpoint path, end to end in a
real daemon. Without a GPU the daemon uses its SIMULATED checkpoint driver, which runs the same
state machine and really SIGSTOPs the process tree, but moves no GPU memory (there is none)."""
from __future__ import annotations

import json
import os
import signal
import sys

from gpuswap_testing import Gate

COUNTER = """import os, time
for i in range(1, {n} + 1):
    while i == {n} and {gate!r} and not os.path.exists({gate!r}):   # held before its last line
        time.sleep(0.05)
    print(i, flush=True)
    time.sleep({dt})
"""


def counter(home, n=300, dt=0.02, gate=None):
    """Prints 1..n; with a gate, it prints n only once the test has opened it (cannot end first)."""
    script = home / "counter.py"
    script.write_text(COUNTER.format(n=n, dt=dt, gate=str(gate.path) if gate else ""))
    return [sys.executable, str(script)]


def test_unmodified_job_is_frozen_and_thawed(daemon, home):
    # Both hold until the test lets them go: the counter cannot end before it is frozen, and the
    # urgent job keeps its GPU until `ls` has shown the counter frozen.
    gate = Gate(home / "go")
    plain = daemon.submit(counter(home, gate=gate), name="plain", priority="low", mem="4GiB")
    daemon.state(plain, "RUNNING")
    urgent = daemon.submit(gate.hold(), name="urgent", priority="urgent")
    j = daemon.until(plain, lambda j: j["state"] == "PAUSED")
    assert j["parked"] == "ram" and j["mechanism"] == "transparent" and j["parked_bytes"] == 4 * 2**30
    assert "frozen transparently (SIMULATED driver)" in j["reason"]
    assert "frozen by the driver" in daemon.cli("ls").stdout
    sup_log = (home / "jobs" / str(plain) / "run-1" / "supervisor.log").read_text()
    assert "SIGSTOP sent" in sup_log
    gpus = daemon.client.get("/v1/gpus")
    assert gpus["ram_parked"] == 4 * 2**30 and gpus["transparent"]["simulated"]
    gate.open()
    assert daemon.cli("wait", str(urgent)).returncode == 0
    done = daemon.state(plain, "COMPLETED", timeout=60)
    reasons = [e["reason"] for e in done["events"]]
    assert any(r.startswith("thawed (SIMULATED driver)") for r in reasons)
    lines = daemon.cli("logs", str(plain)).stdout.split()
    assert lines == [str(i) for i in range(1, 301)]      # the process went on where it stopped
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 0


def test_job_exiting_while_frozen_ends_with_its_code_and_frees_accounting(daemon, home):
    plain = daemon.submit(counter(home, 3000), name="plain", priority="low", mem="2GiB")
    daemon.state(plain, "RUNNING")
    assert daemon.cli("pause", str(plain)).returncode == 0
    daemon.until(plain, lambda j: j["state"] == "PAUSED" and j["mechanism"] == "transparent")
    status = json.loads((home / "jobs" / str(plain) / "run-1" / "status.json").read_text())
    os.kill(status["job_pid"], signal.SIGKILL)
    j = daemon.state(plain, "FAILED")
    assert j["exit_code"] == 137 and "while paused" in j["reason"]
    assert j["parked"] is None and j["assigned_gpus"] == []
    gpus = daemon.client.get("/v1/gpus")
    assert gpus["ram_parked"] == 0 and gpus["gpus"][0]["jobs"] == []


def test_transparent_only_job_is_not_parked_to_disk(daemon, home):
    plain = daemon.submit(counter(home, 3000), name="plain", priority="low", pause_mode="transparent")
    daemon.state(plain, "RUNNING")
    r = daemon.cli("pause", str(plain), "--to", "disk")
    assert r.returncode == 1 and "CRIU" in r.stderr and "Traceback" not in r.stderr
    j = daemon.client.get(f"/v1/jobs/{plain}")
    assert j["state"] == "RUNNING" and j["parked"] is None
    daemon.cli("cancel", str(plain))
