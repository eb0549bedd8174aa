"""A job under a real daemon survives its runtime's usage heartbeat (issue 10 item 1).

The heartbeat used to read the attached tensors' `.grad` and storages from its own thread while
the training thread ran `zero_grad`/`step`: a 9M-parameter MLP crashed with SIGSEGV on every run
at the default 2 s interval. Here the interval is 10 ms (`$GPUSWAP_USAGE_INTERVAL_S`) so that a
2.3M-parameter MLP (hidden width 1500) shows the crash within seconds: the old runtime died on
every run measured, typically within its first 15 steps. Now it must complete, and the daemon
must still learn the job's device memory from the heartbeat.
"""
from __future__ import annotations

import json

from gpuswap_testing import train_cmd

HIDDEN, STEPS = 1500, 40


def test_training_under_fast_heartbeat_completes(daemon, home, monkeypatch):
    monkeypatch.setenv("GPUSWAP_USAGE_INTERVAL_S", "0.01")  # daemon.env (the job's env) copies os.environ
    assert daemon.env["GPUSWAP_USAGE_INTERVAL_S"] == "0.01"
    job = daemon.submit(train_cmd(home / "r.json", STEPS, 0.0, HIDDEN), name="mlp1500")
    done = daemon.state(job, "COMPLETED", "FAILED", "CANCELLED", timeout=300)
    log = home / "jobs" / str(job) / "output.log"
    assert done["state"] == "COMPLETED", (done["events"][-1], log.read_text()[-2000:])
    assert done["exit_code"] == 0 and done["signal"] is None
    assert json.loads((home / "r.json").read_text())["steps"] == STEPS
    # The heartbeat still measures (at safepoints): parameters, gradients and AdamW's two moments
    # of a 2.3M-parameter float32 model are well over 16 MiB.
    assert done["device_bytes"] > 16 << 20, done["device_bytes"]
