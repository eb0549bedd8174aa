"""Parking tiers under the host-RAM budget, with real cooperative jobs on simulated GPUs."""
from __future__ import annotations

import json
import time

from gpuswap.node.store import Store
from gpuswap_testing import Gate


def test_ram_budget_holds_one_park_the_cost_function_chooses_the_other(make_daemon, home, reference_hashes):
    """Two cooperative jobs of ~17 MB each; the budget holds one. For the second victim the policy
    weighs parking it to disk (its GPU held while the checkpoint is written) against spilling the
    first, already parked, to disk (host-side; it pays a slower restart later): with RAM copies
    faster than disk writes, the spill is cheaper, so the first goes to disk and the second to RAM.
    The budget is never exceeded and both end bitwise-exact.

    The two plans differ only by the victim's bytes over RAM-copy vs disk-write bandwidth, so the
    premise is made explicit: the daemon starts with figures it learned before (the same SQLite
    rows real moves leave), RAM 10 GB/s and disk 200 MB/s. Left to calibrate, a loaded machine
    can time a 16 MiB park (mostly fixed costs) slower than its page-cached disk write."""
    store = Store(home / "state.db")
    for field, bps in (("ram_park_bps", 10e9), ("ram_resume_bps", 10e9),
                       ("disk_write_bps", 200e6), ("disk_read_bps", 200e6)):
        store.save_bandwidth(field, bps, 20, time.time())
    store.close()
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "0", "--ram-budget", "24MiB")
    steps, hidden = 120, 1024   # 120: the LR schedule still steps down twice (at 50, 100)
    # Every job holds until the test lets it go: neither low job can finish before it is parked,
    # and both urgent jobs keep their GPUs until both lows are parked.
    low_gate, urgent_gate = Gate(home / "low.go"), Gate(home / "urgent.go")
    lows = [d.submit(low_gate.train(home / f"low{i}.json", steps, 0.02, hidden), name=f"low{i}", priority="low")
            for i in range(2)]
    for low in lows:
        d.until(low, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) > 5)
    urgents = [d.submit(urgent_gate.hold(), name="u0", priority="urgent")]
    d.until(lows[0], lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")  # only a parked job spills
    urgents.append(d.submit(urgent_gate.hold(), name="u1", priority="urgent"))
    peak = 0

    def sample() -> None:
        nonlocal peak
        gpus = d.client.get("/v1/gpus")
        peak = max(peak, gpus["ram_parked"])
        assert gpus["ram_parked"] <= gpus["ram_budget"]
        time.sleep(0.05)      # a sample, not a busy loop: the daemon and the jobs need the CPU

    deadline = time.monotonic() + 120
    while not all(d.job(low)["state"] == "PAUSED" for low in lows):
        assert time.monotonic() < deadline, [d.job(low) for low in lows]
        sample()
    sample()
    low_gate.open()
    urgent_gate.open()
    while d.job(urgents[0])["state"] != "COMPLETED" or d.job(urgents[1])["state"] != "COMPLETED":
        assert time.monotonic() < deadline + 120
        sample()
    tiers, reasons = set(), []
    for low in lows:
        j = d.state(low, "COMPLETED", timeout=120)
        tiers |= {e["reason"].split(":")[0] for e in j["events"] if e["state"] == "PAUSED"}
        reasons += [e["reason"] for e in j["events"]]
        assert json.loads((home / f"low{lows.index(low)}.json").read_text())["sha256"] == reference_hashes(steps, hidden)
    assert {"parked in RAM", "parked to disk"} <= tiers, tiers
    assert any("making room in host RAM" in r for r in reasons), "\n".join(reasons)
    assert 0 < peak <= 24 * 2**20


def test_spill_from_ram_to_disk_and_resume_exactly(daemon, home, reference_hashes):
    steps = 200
    gate = Gate(home / "s.go")       # it cannot finish before the test's three CLI calls
    job = daemon.submit(gate.train(home / "s.json", steps, 0.03), name="s")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert daemon.cli("pause", str(job), "--to", "ram").returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0      # spill
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 0
    assert daemon.cli("resume", str(job)).returncode == 0
    gate.open()
    done = daemon.state(job, "COMPLETED", timeout=120)
    reasons = [e["reason"] for e in done["events"]]
    assert any(r.startswith("spill to disk requested") for r in reasons)
    assert any(r.startswith("restarted from its disk checkpoint at step") for r in reasons)
    assert json.loads((home / "s.json").read_text())["sha256"] == reference_hashes(steps)


def test_lowered_budget_makes_the_policy_spill_a_ram_parked_job(make_daemon, home, reference_hashes):
    """An admin restarts the daemon with a smaller budget: what no longer fits is spilled to disk."""
    steps, hidden = 120, 1024   # 120: the LR schedule still steps down twice (at 50, 100)
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0")
    # The urgent job keeps the GPU until the restarted daemon has spilled the low one (it used to
    # sleep 8 s: a slow restart let it end first and the low job resumed from RAM instead).
    low_gate, urgent_gate = Gate(home / "low.go"), Gate(home / "urgent.go")
    low = d.submit(low_gate.train(home / "low.json", steps, 0.02, hidden), name="low", priority="low")
    d.until(low, lambda j: j["state"] == "RUNNING" and (j["device_bytes"] or 0) > 10 * 2**20)
    urgent = d.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    d.until(low, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    low_gate.open()
    d.stop()
    d.args = ["--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--max-switch-fraction", "1",
              "--ram-budget", "1MiB"]
    d.start()
    j = d.until(low, lambda j: j["parked"] == "disk" or j["state"] == "COMPLETED", timeout=60)
    assert j["parked"] == "disk" and d.client.get("/v1/gpus")["ram_parked"] == 0
    urgent_gate.open()
    d.state(urgent, "COMPLETED", timeout=60)
    d.state(low, "COMPLETED", timeout=120)
    assert json.loads((home / "low.json").read_text())["sha256"] == reference_hashes(steps, hidden)


def test_a_ram_pause_that_became_a_disk_park_says_why_in_the_event(daemon):
    """The runtime's `checkpointed` note (over the RAM budget, a CUDA graph) reaches the event."""
    import sys
    from pathlib import Path

    import noted_job

    job = daemon.submit([sys.executable, str(Path(__file__).parent / "noted_job.py")], name="noted")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert daemon.cli("pause", str(job), "--to", "ram").returncode == 0
    j = daemon.until(job, lambda j: any("parked to disk" in e["reason"] for e in j["events"]))
    (event,) = [e["reason"] for e in j["events"] if "parked to disk" in e["reason"]]
    assert event.endswith(f"; requeued ({noted_job.NOTE})"), event
    assert daemon.cli("cancel", str(job)).returncode == 0
    daemon.state(job, "CANCELLED")
