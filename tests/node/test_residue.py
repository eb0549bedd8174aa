"""What stays on the GPU after a cooperative RAM park (issue 12, bug 5), end to end: a real daemon on
simulated GPUs, real training jobs whose runtime registers them as simulated CUDA processes holding
a context floor (runtime/simdevice.py), real SQLite. A park cannot free the floor: the daemon
measures it, shows it, and does not start a job into it."""
from __future__ import annotations

import json
import sys

from gpuswap_testing import Daemon, Gate

MiB, GiB = 2**20, 2**30
FLOOR = 512 * MiB
STEPS, HIDDEN = 150, 64


def _low(d: Daemon, gate: Gate, out, **opts) -> int:
    env = {**d.env, "GPUSWAP_SIM_CONTEXT_BYTES": str(FLOOR)}
    return d.submit(gate.train(out, STEPS, 0.02, HIDDEN), name="low", priority="low", env=env, **opts)


def _using(d: Daemon, gate: Gate, declared: int, **opts) -> int:
    """A job that holds what it declares on its (simulated) GPU, its context included, until the
    gate opens: started where that memory is not free, it fails with CUDA's out-of-memory error, as
    on a real GPU (simcuda.allocate is strict about room)."""
    env = {**d.env, "GPUSWAP_SIM_CONTEXT_BYTES": str(FLOOR)}
    take = f"from gpuswap import simcuda; simcuda.allocate({declared - FLOOR})"
    return d.submit(gate.hold(before=take), env=env, mem=str(declared), **opts)


def _gpu0(d: Daemon) -> dict:
    return d.client.get("/v1/gpus")["gpus"][0]


def _events(j: dict) -> list[str]:
    return [e["reason"] for e in j["events"]]


def test_a_job_that_does_not_fit_beside_the_floor_is_not_started_into_it(make_daemon, home, reference_hashes):
    """1 GPU of 2 GiB. The low job is parked in RAM for an urgent job that declares 1.8 GiB; the
    park leaves its 0.5 GiB context floor, so the urgent job is not started beside it: the policy
    moves the low job to disk (its process exits, the floor with it), and only then starts the
    urgent job. The low job resumes from its checkpoint bitwise-exactly."""
    d = make_daemon("--simulate-gpus", "1x2GiB", "--min-runtime", "0")
    low_gate, urgent_gate = Gate(home / "low.go"), Gate(home / "urgent.go")
    low = _low(d, low_gate, home / "low.json")
    j = d.until(low, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j["step"] or 0) >= 5)
    [proc] = d.until(low, lambda g: len(g["gpus"][0]["processes"]) == 1, get="/v1/gpus")["gpus"][0]["processes"]
    assert proc["used_bytes"] >= FLOOR             # a simulated CUDA process: the floor and its tensors
    urgent = d.submit(urgent_gate.hold(), name="urgent", priority="urgent", mem="1.8GiB")
    u = d.state(urgent, "RUNNING", timeout=180)
    j = d.job(low)
    assert j["state"] == "PAUSED" and j["parked"] == "disk", j
    assert _gpu0(d)["processes"] == []             # the disk park exited: the floor went with it
    reasons = _events(j)
    stayed = [r for r in reasons if r.startswith("parked in RAM")]
    if stayed:     # parked in RAM first (nothing was known of its floor yet), then moved to disk for it
        assert "512.0 MiB stays on GPU 0" in stayed[0], reasons
        assert any(r.startswith("spilling from RAM to disk") and f"too little for job {urgent}" in r
                   for r in reasons), reasons
        assert any(e["reason"].startswith("waiting (Residue)") and "512.0 MiB" in e["reason"]
                   for e in u["events"]), _events(u)
    parked_to_disk = next(e["time"] for e in j["events"] if e["reason"].startswith("parked to disk"))
    started = next(e["time"] for e in u["events"] if e["state"] == "RUNNING")
    assert started >= parked_to_disk, (reasons, _events(u))
    urgent_gate.open()
    low_gate.open()
    assert d.state(urgent, "COMPLETED", "FAILED", timeout=120)["state"] == "COMPLETED"
    done = d.state(low, "COMPLETED", "FAILED", timeout=180)
    assert done["state"] == "COMPLETED", _events(done)
    assert json.loads((home / "low.json").read_text())["sha256"] == reference_hashes(STEPS, HIDDEN)


def test_the_floor_stays_listed_counted_and_shown_while_a_job_that_fits_runs_beside_it(make_daemon, home,
                                                                                      reference_hashes):
    """1 GPU of 2 GiB; the urgent job declares 1 GiB, which fits beside the 0.5 GiB floor: it runs
    there while the low job is parked in RAM. The simulated NVML list shows the low job's process
    with the floor alone; `gpus` counts it as used and names the parked job; `show` and `ls` say
    what stays on GPU 0; on resume its tensors are back in the list. Once the floor is known, a
    later job that would not fit beside it has the low job parked straight to disk."""
    d = make_daemon("--simulate-gpus", "1x2GiB", "--min-runtime", "0")
    low_gate, urgent_gate = Gate(home / "low.go"), Gate(home / "urgent.go")
    low = _low(d, low_gate, home / "low.json")
    j = d.until(low, lambda j: j["state"] == "RUNNING" and (j["device_bytes"] or 0) > 0 and (j["step"] or 0) >= 5)
    running = d.until(low, lambda g: [p["used_bytes"] for p in g["gpus"][0]["processes"]] == [FLOOR + j["device_bytes"]],
                      get="/v1/gpus")["gpus"][0]["processes"]
    urgent = _using(d, urgent_gate, GiB, name="urgent", priority="urgent")   # beside the floor: it fits
    d.state(urgent, "RUNNING", timeout=180)
    p = d.state(low, "PAUSED")
    assert p["parked"] == "ram" and p["residue"] == [{"gpu": 0, "bytes": FLOOR}], p
    assert any(r.startswith("parked in RAM") and "512.0 MiB stays on GPU 0" in r for r in _events(p)), _events(p)
    g = d.until(low, lambda g: len(g["gpus"][0]["processes"]) == 2, get="/v1/gpus")["gpus"][0]   # urgent's allocated
    assert (running[0]["pid"], FLOOR) in [(x["pid"], x["used_bytes"]) for x in g["processes"]]
    assert sorted(x["used_bytes"] for x in g["processes"]) == [FLOOR, GiB]
    assert g["mem_used"] >= FLOOR
    assert {x["id"]: x["residue_bytes"] for x in g["jobs"]} == {urgent: 0, low: FLOOR}
    text = d.cli("gpus").stdout
    assert f"{low} low PAUSED (parked in RAM, keeps 512.0 MiB)" in text, text
    show = d.cli("show", str(low)).stdout
    assert "512.0 MiB stays on GPU 0" in show, show
    assert "512.0 MiB stays on GPU 0" in d.cli("ls").stdout
    top = d.client.get("/v1/overview")
    assert [r for r in top["gpus"][0]["residue"]] == [{"job": low, "bytes": FLOOR}]
    urgent_gate.open()
    d.state(urgent, "COMPLETED", timeout=120)
    back = d.until(low, lambda j: j["state"] == "RUNNING" and j["residue"] == [])
    d.until(low, lambda g: [x["used_bytes"] for x in g["gpus"][0]["processes"]] == [FLOOR + back["device_bytes"]],
            get="/v1/gpus")
    # Its floor is known now: a job that would not fit beside it has it parked to disk at once.
    big_gate = Gate(home / "big.go")
    big = _using(d, big_gate, 18 * GiB // 10, name="big", priority="urgent")   # beside the floor it would OOM
    d.state(big, "RUNNING", timeout=180)
    j = d.job(low)
    assert j["state"] == "PAUSED" and j["parked"] == "disk", j
    pauses = [e["reason"] for e in j["events"] if e["state"] == "PAUSING"]
    assert len(pauses) == 2 and pauses[1].startswith("pausing to disk"), pauses
    assert sum(r.startswith("parked in RAM") for r in _events(j)) == 1, _events(j)
    big_gate.open()
    low_gate.open()
    assert d.state(big, "COMPLETED", "FAILED", timeout=120)["state"] == "COMPLETED"
    assert d.state(low, "COMPLETED", "FAILED", timeout=180)["state"] == "COMPLETED"
    assert json.loads((home / "low.json").read_text())["sha256"] == reference_hashes(STEPS, HIDDEN)


def test_a_users_ram_pause_keeps_its_floor_reserved(make_daemon, home):
    """A job its user paused to RAM is outside the policy's snapshot (it waits for its user), but
    its floor is not: a job that does not fit beside it waits, and says why with the numbers."""
    d = make_daemon("--simulate-gpus", "1x2GiB", "--min-runtime", "0")
    gate = Gate(home / "low.go")
    low = _low(d, gate, home / "low.json")
    d.until(low, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j["step"] or 0) >= 5)
    assert d.cli("pause", str(low), "--to", "ram").returncode == 0
    d.until(low, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    big = d.submit([sys.executable, "-c", "pass"], name="big", priority="urgent", mem="1.8GiB")
    w = d.until(big, lambda j: j["pending_reason"] == "Residue" or j["state"] != "PENDING")
    assert w["state"] == "PENDING", _events(w)          # not started into the floor
    assert d.job(low)["residue"] == [{"gpu": 0, "bytes": FLOOR}]
    assert "512.0 MiB" in w["pending_reason_text"] and "1.8 GiB" in w["pending_reason_text"], w["pending_reason_text"]
    assert "paused by their users" in w["pending_reason_text"], w["pending_reason_text"]
    assert d.cli("cancel", str(low)).returncode == 0     # the floor goes with the process
    assert d.state(big, "COMPLETED", "FAILED", timeout=120)["state"] == "COMPLETED"
    gate.open()


def test_a_database_written_before_the_residue_column_opens_and_gains_it(home, make_daemon):
    """The previous version's `jobs` table had no `residue`: the store adds it at open (every old
    row reads as nothing kept), and the daemon serves the old jobs."""
    import sqlite3
    import time

    from gpuswap.node.schema import BASELINE_DDL as SCHEMA
    from gpuswap.node.store import Store

    column = "    residue TEXT NOT NULL DEFAULT '{}',\n"
    assert column in SCHEMA
    db = sqlite3.connect(home / "state.db")
    db.executescript(SCHEMA.replace(column, ""))
    now = time.time()
    db.execute("INSERT INTO jobs (id,name,user,uid,gid,cwd,priority,gpus,mem_bytes,preemptible,state,reason,"
               "submit_time,state_since,end_time,version) VALUES (1,'old','root',0,0,?,1,1,0,1,'COMPLETED','old',"
               "?,?,?,1)", (str(home), now - 100, now - 60, now - 60))
    db.execute("INSERT INTO job_specs (job_id,argv_bytes,argv,env) VALUES (1,6,'[\"true\"]',NULL)")
    db.commit()
    db.close()
    store = Store(home / "state.db")
    assert store.get(1).residue == {}
    store.update(1, now, residue={0: FLOOR})
    store.close()
    store = Store(home / "state.db")             # opening again adds nothing twice
    assert store.get(1).residue == {0: FLOOR}
    store.close()
    d = make_daemon("--simulate-gpus", "1x2GiB")
    old = d.job(1)
    assert old["state"] == "COMPLETED" and old["name"] == "old" and old["residue"] == []
    assert d.submit(["true"]) == 2
