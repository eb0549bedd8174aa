"""Failures of a multi-rank job under a real daemon (torchrun, 2 gloo ranks, simulated GPUs): each
ends in a defined state with its reason, and no rank process is left running or stopped
(torchrun's workers lead sessions of their own, outside the job's session).
docs/design/multi-rank.md, section 6."""
from __future__ import annotations

import pytest

import json
import os
import signal
import time
from pathlib import Path

from mr_testing import alive, parent, torchrun
from gpuswap_testing import FACT_TIMEOUT_S, Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLD_AT = 12, 10


def _parked(d, home, name):
    gate = Gate(home / f"{name}.go")
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(home / name), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT)), name=name, gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
                and all(r["state"] == "parked" for r in j["ranks"]))
    pids = [r["pid"] for r in j["ranks"]]
    launcher = parent(pids[0])
    assert all(alive(p) for p in pids + [launcher]) and all(os.getsid(p) == p for p in pids)  # own sessions
    return gate, job, pids, launcher


def _gone(d, job, pids):
    j = d.state(job, "FAILED", "COMPLETED", "CANCELLED")
    assert j["state"] == "FAILED", j["events"]
    left = [p for p in pids if alive(p)]
    assert not left, f"rank processes left alive: {left}"
    return j["events"][-1]["reason"]


def test_a_rank_killed_while_parked_fails_the_job_and_kills_the_rest(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, job, pids, launcher = _parked(d, home, "k")
    os.kill(pids[1], signal.SIGKILL)
    reason = _gone(d, job, pids + [launcher])
    # Whichever the supervisor saw first, the rank's connection closing or the launcher's exit,
    # the reason says the job was parked and cannot go on.
    assert "while the job was parked" in reason, reason
    gate.open()


def test_the_launcher_killed_while_parked_fails_the_job_and_kills_its_ranks(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, job, pids, launcher = _parked(d, home, "l")
    os.kill(launcher, signal.SIGKILL)
    reason = _gone(d, job, pids + [launcher])
    assert "while the job was parked" in reason and "SIGKILL" in reason, reason
    gate.open()


def test_a_rank_that_never_attaches_makes_the_pause_time_out_with_the_reason(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", "5")
    gate = Gate(home / "n.go")
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(home / "n"), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT), "--no-attach", "1"), name="n", gpus=2,
                   pause_mode="cooperative")
    d.until(job, lambda j: j["state"] == "RUNNING" and [r["rank"] for r in j["ranks"]] == [0])
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    j = d.until(job, lambda j: any("cannot park" in e["reason"] for e in j["events"]), timeout=FACT_TIMEOUT_S)
    assert j["state"] == "RUNNING" and not j["parked"]
    assert any("cannot park (1 of 2 ranks attached)" in e["reason"] for e in j["events"]), j["events"]
    assert all(r["state"] == "running" for r in j["ranks"])
    gate.open()
    assert d.state(job, "COMPLETED", "FAILED")["state"] == "COMPLETED"


def _until(what: str, fact):
    """Poll a fact outside the daemon's API (a file, the supervisor's status.json)."""
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while True:
        got = fact()
        if got:
            return got
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def _status(home: Path, job: int) -> dict:
    try:
        return json.loads((home / "jobs" / str(job) / "run-1" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _agreeing(rt: dict) -> dict:
    """The supervisor's facts once the agreement is under way and every rank has said where it is."""
    ranks = rt.get("ranks") or []
    return rt if rt.get("phase") == "agreeing" and ranks and all(r["tick"] is not None for r in ranks) else {}


def test_a_rank_hung_mid_park_ends_the_job_within_the_pause_timeout(make_daemon, home):
    # Rank 1 destroys its group and then blocks forever in its park (a test hook mr_job.py arms):
    # the coordinator's deadline for the parking phase ends the job, with the reason, and every
    # rank process is killed (none left blocked, stopped or holding memory).
    # 10 s: enough for the agreement itself on a loaded machine (a slower one is withdrawn instead).
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", "10")
    gate = Gate(home / "h.go")
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(home / "h"), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT), "--hang-in-park", "1"), name="h", gpus=2)
    j = d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    pids = [r["pid"] for r in j["ranks"]]
    launcher = parent(pids[0])
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    reason = _gone(d, job, pids + [launcher])
    assert "rank 1" in reason and "did not finish parking within 10 s" in reason, reason
    assert "rank 0" not in reason.split("(main process")[0], reason   # rank 0 parked; only rank 1 is late
    # Past the agreement the coordinator owns the deadline: the daemon never took the job for one
    # that reached no safepoint and was "left running" (rank 0 had parked, its group was gone).
    events = [e["reason"] for e in d.job(job)["events"]]
    assert not any("left running" in e for e in events), events
    gate.open()


def test_a_rank_killed_during_the_agreement_withdraws_the_pause_and_the_job_fails(make_daemon, home):
    # Rank 1 blocks outside any safepoint, so the pause cannot reach its common step; once both
    # ranks have told the coordinator where they are (the agreement is under way, nothing is torn
    # down), rank 1 is SIGKILLed: the pause is withdrawn and the launcher ends the job, FAILED with
    # its exit; no rank process is left.
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", "600")
    gate, block = Gate(home / "a.go"), home / "a.block"
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(home / "a"), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT), "--block-rank", "1", "--block-file", str(block)),
                   name="a", gpus=2)
    j = d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    pids = [r["pid"] for r in j["ranks"]]
    launcher = parent(pids[0])
    block.touch()
    _until("rank 1 blocked", lambda: Path(f"{block}.ack").exists())
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    rt = _until("both ranks marked in the agreement", lambda: _agreeing(_status(home, job).get("runtime", {})))
    assert [r["state"] for r in rt["ranks"]][1] == "running"
    os.kill(pids[1], signal.SIGKILL)
    reason = _gone(d, job, pids + [launcher])
    assert "exited with code 1" in reason, reason      # torchrun's verdict on a group with a dead rank
    rt = _status(home, job)["runtime"]
    # status.json keeps the coordinator's last reason: rank 0, SIGTERMed by torchrun, may still say
    # `done` at its exit ("rank 0 finished training"); the supervisor's log keeps each turn.
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    assert rt["phase"] == "running", rt
    assert "pause withdrawn: rank 1 exited or disconnected" in rt["error"] + log, (rt, log[-3000:])
    gate.open()
