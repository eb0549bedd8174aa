"""A multi-rank job parked in RAM stays parked for as long as the daemon wants it parked: the pause
timeout bounds each *move* of the common-step protocol (agreeing, parking, unparking, regrouping),
never the time the job spends parked. Before, the supervisor's coordinator applied the timeout to
the parked phase too and killed every rank of a job parked longer than `--pause-timeout`
("did not finish parked within 10 s"), losing it. A real daemon, torchrun with 2 gloo ranks,
simulated GPUs. docs/design/multi-rank.md section 6."""
from __future__ import annotations

import json
import time

import pytest

from mr_testing import assert_bitwise, load, reference, torchrun
from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLD_AT = 12, 10
TIMEOUT_S = 10       # the pause timeout: enough for the agreement itself on a loaded machine


def _supervisor_log(home, job) -> str:
    try:
        return (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    except OSError:
        return ""


def test_a_job_parked_in_ram_longer_than_the_pause_timeout_stays_parked_and_resumes(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", str(TIMEOUT_S))
    gate, out, ref = Gate(home / "go"), home / "out", home / "ref"
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT)), name="long", gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
            and all(r["state"] == "parked" for r in j["ranks"]))
    # The supervisor entered the parked phase before the daemon saw it parked: from now on, once
    # more than the timeout has passed, its coordinator has had the chance to act on a deadline
    # (it looks every 50 ms); a later usage report proves its threads still run.
    parked_seen = time.monotonic()
    while time.monotonic() - parked_seen < 2 * TIMEOUT_S:
        j = d.job(job)
        assert j["state"] == "PAUSED", (j["events"], _supervisor_log(home, job)[-3000:])
        time.sleep(0.5)
    j = d.job(job)
    assert j["state"] == "PAUSED" and j["parked"] == "ram", (j["events"], _supervisor_log(home, job)[-3000:])
    assert all(r["state"] == "parked" and r["connected"] for r in j["ranks"]), j["ranks"]
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] != "PAUSED")
    gate.open()
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", (json.dumps(done["events"], indent=1), _supervisor_log(home, job)[-3000:])
    reference(ref, 2, STEPS)
    for rank in (0, 1):
        a, b = load(ref / "ddp", rank), load(out / "ddp", rank)
        for key in ("params", "optimizer", "rng", "data"):
            assert_bitwise(a[key], b[key], f"rank {rank} {key}")
