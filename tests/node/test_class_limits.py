"""Classes with limits in the live daemon (issue 15 item 5): the class budget is kept by the
controller from real run time, and a job over it is treated one class down, with a reason that says so."""
from __future__ import annotations

import json

from gpuswap_testing import Gate


def test_an_urgent_job_over_its_users_budget_is_preempted_by_a_high_one(make_daemon, home, reference_hashes):
    # A budget of 0 GPU-hours: the urgent job's user is over it once the job has run at all. Its
    # user's high job then has the head start (no high usage yet) and takes the only GPU.
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--class-budget", "0")
    steps = 150
    gate, high_gate = Gate(home / "u.go"), Gate(home / "h.go")
    urgent = d.submit(gate.train(home / "u.json", steps), name="svc", priority="urgent", mem="4GiB")
    d.until(urgent, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 20)
    high = d.submit(high_gate.hold("print('ok')"), name="deadline", priority="high")
    parked = d.until(urgent, lambda j: j["state"] == "PAUSED")
    pause = next(e for e in parked["events"] if e["state"] == "PAUSING")
    assert f"preempted by job {high} (high)" in pause["reason"], pause
    assert "this job counts as high: its user is over the urgent budget" in pause["reason"], pause
    high_gate.open()
    assert d.cli("wait", str(high)).returncode == 0
    gate.open()
    d.state(urgent, "COMPLETED", timeout=120)
    assert json.loads((home / "u.json").read_text())["sha256"] == reference_hashes(steps)


def test_class_usage_survives_a_restart_and_what_decayed_away_stays_away(tmp_path):
    from gpuswap.node.store import Store

    store = Store(tmp_path / "state.db")
    assert store.load_class_usage() == {}
    store.save_class_usage({("ann", 3): 7200.0, ("bob", 2): 60.0}, 1000.0)
    store.save_class_usage({("ann", 3): 3600.0}, 2000.0)        # bob's usage decayed to nothing
    assert Store(tmp_path / "state.db").load_class_usage() == {("ann", 3): 3600.0}
