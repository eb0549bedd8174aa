"""A disk-parked job whose checkpoint went bad never silently starts over (issue 10 item 8).

Real daemon, real job: park to disk, damage the checkpoint files on disk (format in
tests/runtime/test_rt_checkpoint_format.py), resume, and read the job's final state and events.
"""
from __future__ import annotations

import json
from pathlib import Path

from gpuswap_testing import Gate, train_cmd

STEPS = 5000


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _park_to_disk(daemon, job: int, past_step: int) -> dict:
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j["step"] or 0) > past_step)
    r = daemon.cli("pause", str(job), "--to", "disk")
    assert r.returncode == 0, r.stderr
    return daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")


def _reasons(j: dict) -> str:
    return " | ".join(e["reason"] for e in j["events"])


def _ckpt(home: Path, job: int) -> Path:
    return home / "jobs" / str(job) / "ckpt"


def test_no_usable_checkpoint_fails_with_reason_and_keeps_files(daemon, home):
    job = daemon.submit(train_cmd(home / "r.json", STEPS, 0.02), name="bad")
    _park_to_disk(daemon, job, 5)
    payloads = sorted(_ckpt(home, job).glob("ckpt-*.pt"))
    assert len(payloads) == 1
    _flip(payloads[0])
    assert daemon.cli("resume", str(job)).returncode == 0
    done = daemon.state(job, "COMPLETED", "FAILED", "CANCELLED", timeout=120)
    assert done["state"] == "FAILED", _reasons(done)
    last = done["events"][-1]["reason"]
    assert "cannot resume: no usable checkpoint" in last and "sha256" in last, last
    assert "GPUSWAP_RESTART_ON_BAD_CHECKPOINT=1" in last
    assert "restarted" not in _reasons(done)
    assert not (home / "r.json").exists()  # it never trained from step 0
    assert payloads[0].exists()  # the evidence stays
    show = daemon.cli("show", str(job))
    assert "no usable checkpoint" in show.stdout, show.stdout


def test_restart_when_asked_says_step_0_and_why(daemon, home, monkeypatch):
    monkeypatch.setenv("GPUSWAP_RESTART_ON_BAD_CHECKPOINT", "1")  # the job's env copies os.environ
    gate = Gate(home / "gate")     # the job cannot finish before the test has parked it
    job = daemon.submit(gate.train(home / "r.json", 150, 0.02), name="restart")
    _park_to_disk(daemon, job, 5)
    manifest = next(_ckpt(home, job).glob("ckpt-*.json"))
    manifest.write_text("{not json")
    gate.open()
    assert daemon.cli("resume", str(job)).returncode == 0
    done = daemon.state(job, "COMPLETED", "FAILED", "CANCELLED", timeout=120)
    assert done["state"] == "COMPLETED", _reasons(done)
    restart = next(e["reason"] for e in done["events"] if "restarted" in e["reason"])
    assert "restarted from step 0" in restart and "unreadable" in restart, restart
    assert "disk checkpoint at step" not in restart
    assert json.loads((home / "r.json").read_text())["start_step"] == 0


def test_bad_newest_falls_back_to_older_and_says_so(daemon, home):
    job = daemon.submit(train_cmd(home / "r.json", STEPS, 0.02), name="older")
    first = _park_to_disk(daemon, job, 5)
    assert daemon.cli("resume", str(job)).returncode == 0
    _park_to_disk(daemon, job, first["step"] + 5)
    manifests = sorted(_ckpt(home, job).glob("ckpt-*.json"))
    assert len(manifests) == 2
    older, newest = (json.loads(m.read_text()) for m in manifests)
    _flip(_ckpt(home, job) / newest["payload"])
    assert daemon.cli("resume", str(job)).returncode == 0
    j = daemon.until(job, lambda j: j["state"] == "RUNNING" and _reasons(j).count("restarted") == 2)
    last = [e["reason"] for e in j["events"] if "restarted" in e["reason"]][-1]
    assert f"restarted from its disk checkpoint at step {older['step']}" in last, last
    assert f"used seq {older['seq']} (step {older['step']})" in last and "sha256" in last, last
    daemon.cli("cancel", str(job))
    daemon.state(job, "CANCELLED", timeout=60)
