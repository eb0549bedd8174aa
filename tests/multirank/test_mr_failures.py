"""Failures of a multi-rank job under a real daemon (torchrun, 2 gloo ranks, simulated GPUs): each
ends in a defined state with its reason, and no rank process is left running or stopped
(torchrun's workers lead sessions of their own, outside the job's session).
docs/design/multi-rank.md, section 6."""
from __future__ import annotations

import os
import signal

from mr_testing import alive, parent, torchrun
from gpuswap_testing import FACT_TIMEOUT_S, Gate

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
