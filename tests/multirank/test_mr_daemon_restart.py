"""kill -9 of the daemon while a multi-rank job parks or resumes loses nothing: the job's supervisor
carries the common-step protocol on alone, the restarted daemon reads where the job stands, and
the job ends bitwise equal to plain torchrun. A real daemon, torchrun with 2 gloo ranks, simulated
GPUs. docs/design/multi-rank.md section 6."""
from __future__ import annotations

import json
import time

import pytest

from mr_testing import completes_bitwise, torchrun
from gpuswap_testing import FACT_TIMEOUT_S, Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLDS = 16, (6, 12)


def _status(home, job: int, run: int) -> dict:
    try:
        return json.loads((home / "jobs" / str(job) / f"run-{run}" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _desired(home, job: int) -> dict:
    try:
        return json.loads((home / "jobs" / str(job) / "run-1" / "desired.json").read_text())
    except (OSError, ValueError):
        return {}


def _until(what: str, fact):
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while not (got := fact()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
    return got


def _events(j, start):
    return sum(e["reason"].startswith(start) for e in j["events"])


def test_daemon_killed_during_multi_rank_parks_and_resumes_converges(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, out, ref = Gate(home / "go"), home / "out", home / "ref"
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", ",".join(map(str, HOLDS))), name="mr", gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    # RAM: the daemon dies once the supervisor has been asked; the ranks park without it.
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    _until("asked", lambda: _desired(home, job).get("tier") == "ram")
    d.kill9()
    _until("parked", lambda: _status(home, job, 1).get("runtime", {}).get("phase") == "parked")
    d.start()
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
            and all(r["state"] == "parked" for r in j["ranks"]))
    # Resume: the daemon dies once the supervisor has been told.
    assert d.cli("resume", str(job)).returncode == 0
    _until("told to run", lambda: _desired(home, job).get("run") == "running" and _status(home, job, 1).get("runtime", {}).get("phase") != "parked")
    d.kill9()
    _until("running again", lambda: _status(home, job, 1).get("runtime", {}).get("phase") == "running")
    d.start()
    d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "resumed from RAM") == 1)
    # Disk: the daemon dies once asked; the ranks write their parts, rank 0 commits, they leave.
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    _until("asked", lambda: _desired(home, job).get("tier") == "disk")
    d.kill9()
    st = _until("the launch ended", lambda: _status(home, job, 1).get("exit") and _status(home, job, 1))
    assert st["runtime"]["state"] == "checkpointed", st
    d.start()
    j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert _events(j, "parked to disk") == 1, j["events"]
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "restarted from its disk checkpoint") == 1)
    completes_bitwise(d, job, gate, ref, out, STEPS)
