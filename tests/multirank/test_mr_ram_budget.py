"""A multi-rank RAM park never takes more host RAM than the daemon allowed it (`max_bytes`, what
the RAM budget has left): a park whose ranks hold more goes to disk, with the reason. The
coordinator decides from the bytes each rank reported, and a rank reported only what it last
measured: a pause asked for before the first step (the optimizer's state, gradients: three times
the parameters for AdamW) was decided on the parameters alone and parked everything in RAM,
over the budget (a host out of memory takes every user's jobs with it). Now each rank measures
at the common step, before it says it is ready. A real daemon, torchrun with 2 gloo ranks,
simulated GPUs."""
from __future__ import annotations

import json
import time

import pytest

from mr_testing import completes_bitwise, torchrun
from gpuswap_testing import FACT_TIMEOUT_S, Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLD_AT = 8, 4
# mr_job.py's DDP model: 1,348 float parameters, 5,392 bytes per rank before the first step;
# with gradients and AdamW's two moments after it, about 21.6 KB per rank.
BUDGET = 24 * 1024


def _status(home, job: int) -> dict:
    try:
        return json.loads((home / "jobs" / str(job) / "run-1" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_pause_before_the_first_step_respects_the_ram_budget(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--ram-budget", str(BUDGET))
    gate, out, ref, wait = Gate(home / "go"), home / "out", home / "ref", home / "first-step"
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT), "--wait-file", str(wait)), name="budget", gpus=2)
    j = d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    assert sum(r["device_bytes"] for r in j["ranks"]) < BUDGET      # what the ranks said at attach
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while _status(home, job).get("runtime", {}).get("target_tick") != 1:   # both ranks marked, none stepped
        assert time.monotonic() < deadline, _status(home, job)
        time.sleep(0.05)
    wait.touch()                              # the first step: optimizer state and gradients appear
    j = d.until(job, lambda j: j["state"] in ("FAILED", "COMPLETED")
                or (j["state"] == "PAUSED" and j["parked"] in ("ram", "disk")))
    assert j["state"] == "PAUSED", j["events"]
    if j["parked"] == "ram":        # what it did before: everything in RAM, over the budget
        assert j["parked_bytes"] <= BUDGET, f"parked {j['parked_bytes']} bytes in RAM, the budget is {BUDGET}"
    assert j["parked"] == "disk", j["events"]
    assert any("exceed the RAM budget" in e["reason"] for e in j["events"]), j["events"]
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and len(j["ranks"]) == 2
            and all(r["connected"] and r["state"] == "running" for r in j["ranks"]))
    completes_bitwise(d, job, gate, ref, out, STEPS)
