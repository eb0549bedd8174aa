"""Preemption end to end: an urgent job takes the busy GPU; the parked job resumes bitwise-exactly."""
from __future__ import annotations

import json
import time

from gpuswap_testing import Gate


def test_urgent_preempts_low_ram_park_and_exact_resume(daemon, home, reference_hashes):
    steps = 150
    # Both jobs hold until the test lets them go: the long one cannot finish before it is
    # preempted, and the urgent one keeps it PAUSED until `ls` has shown it so.
    long_gate, urgent_gate = Gate(home / "long.go"), Gate(home / "urgent.go")
    long_id = daemon.submit(long_gate.train(home / "long.json", steps), name="long", priority="low", mem="20GiB")
    daemon.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 20)
    urgent = daemon.submit(urgent_gate.hold("print('eval ok')"), name="urgent", priority="urgent")
    parked = daemon.until(long_id, lambda j: j["state"] == "PAUSED")
    assert parked["parked"] == "ram" and parked["parked_bytes"] > 0
    long_gate.open()
    ls = daemon.cli("ls").stdout
    assert "PAUSED (parked in RAM" in ls
    urgent_gate.open()
    w = daemon.cli("wait", str(urgent))
    assert w.returncode == 0
    done = daemon.state(long_id, "COMPLETED", timeout=120)
    states = [e["state"] for e in done["events"] if not e["reason"].startswith("waiting (")]
    assert states == ["PENDING", "RUNNING", "PAUSING", "PAUSED", "RESUMING", "RUNNING", "COMPLETED"]
    # While parked, why it waited is in its log: the urgent job holds the GPU its state is tied to.
    assert any(e["state"] == "PAUSED" and e["reason"].startswith("waiting (Priority): waiting for its own GPU 0")
               and f"held by job {urgent} (urgent, not preemptible by a lower priority)" in e["reason"]
               for e in done["events"]), done["events"]
    assert "preempted by job" in done["events"][2]["reason"]
    assert done["preemptions"] == 1
    assert json.loads((home / "long.json").read_text())["sha256"] == reference_hashes(steps)


def test_no_preempt_within_min_runtime(make_daemon, home):
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "6")
    # Held at its last steps until cancelled: it is still there to preempt, however slow the machine.
    long_id = d.submit(Gate(home / "never").train(home / "l.json", 2000, 0.01), name="long", priority="low")
    d.state(long_id, "RUNNING")
    urgent = d.submit(["true"], name="urgent", priority="urgent")
    j = d.until(long_id, lambda j: j["state"] != "RUNNING", timeout=30)
    pause_event = next(e for e in j["events"] if e["state"] == "PAUSING")
    start_event = next(e for e in j["events"] if e["state"] == "RUNNING")
    assert pause_event["time"] - start_event["time"] >= 6.0
    d.state(urgent, "COMPLETED", timeout=60)
    d.cli("cancel", str(long_id))


def test_no_preempt_flag_and_equal_priority_wait(daemon, home):
    # Held until cancelled: "still RUNNING, the other still PENDING" cannot be its having ended.
    long_id = daemon.submit(Gate(home / "never").train(home / "l.json", 2000, 0.01), name="long", priority="low",
                            preemptible=False)
    daemon.state(long_id, "RUNNING")
    normal = daemon.submit(["true"], name="other", priority="urgent")
    time.sleep(3)
    assert daemon.job(long_id)["state"] == "RUNNING"
    assert daemon.job(normal)["state"] == "PENDING"
    daemon.cli("cancel", str(long_id))
    daemon.state(normal, "COMPLETED", timeout=30)


def test_manual_pause_disk_and_ram_many_times_is_exact(daemon, home, reference_hashes):
    steps = 300
    gate = Gate(home / "m.go")     # the job cannot finish before its fourth pause, however slow the CLI
    job = daemon.submit(gate.train(home / "m.json", steps, 0.03), name="m", priority="normal")
    for tier in ["ram", "disk", "ram", "disk"]:
        daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
        time.sleep(0.3)            # some steps between parks (a lower bound, not a window)
        r = daemon.cli("pause", str(job), "--to", tier)
        assert r.returncode == 0, r.stderr
        j = daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == tier)
        assert j["parked_bytes"] > 0
        assert daemon.cli("resume", str(job)).returncode == 0
    gate.open()
    done = daemon.state(job, "COMPLETED", timeout=120)
    reasons = " | ".join(e["reason"] for e in done["events"])
    assert reasons.count("parked to disk") == 2 and reasons.count("parked in RAM") == 2
    assert "restarted from its disk checkpoint at step" in reasons
    assert json.loads((home / "m.json").read_text())["sha256"] == reference_hashes(steps)


def test_policy_is_selectable_fifo_never_preempts(make_daemon, home):
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--policy", "fifo")
    gate = Gate(home / "long.go")     # RUNNING cannot be missed: the long job ends when the test says
    # keep_pace: the gate opens as the job starts, and the urgent job must still find it running.
    long_id = d.submit(gate.train(home / "l.json", 60, 0.05, keep_pace=True), name="long", priority="low")
    d.state(long_id, "RUNNING")
    urgent = d.submit(["true"], name="urgent", priority="urgent")
    gate.open()
    d.state(long_id, "COMPLETED", timeout=60)
    j = d.state(urgent, "COMPLETED", timeout=60)
    assert d.job(long_id)["preemptions"] == 0
    started = [e for e in j["events"] if e["state"] == "RUNNING"][0]
    assert started["time"] >= d.job(long_id)["end_time"]
    assert any(e["reason"].startswith("waiting (NoPreemption): ") for e in j["events"]), j["events"]
