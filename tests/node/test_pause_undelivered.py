"""A pause the daemon could not deliver is not the job's fault.

The daemon records a pause (PAUSING) and then writes desired.json for the job's supervisor. When
that write fails (a full disk), the request never reaches the job; the pause timeout used to run
from the record all the same, blamed the job ("no safepoint reached") and marked it unparkable for
the rest of its launch. Here the write fails as on a full disk, the old file left as it was: the
daemon's temporary file's name is taken by a directory (its open fails with EISDIR), for longer
than the pause timeout; then it is removed.
"""
from __future__ import annotations

import json
import time

from gpuswap_testing import Gate

PAUSE_TIMEOUT_S = 6


def test_a_pause_that_cannot_be_written_waits_and_parks_once_it_is(make_daemon, home, reference_hashes):
    daemon = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--pause-timeout", str(PAUSE_TIMEOUT_S))
    steps = 200
    gate = Gate(home / "t.go")
    job = daemon.submit(gate.train(home / "t.json", steps, 0.03), name="t")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    pid = daemon.client.get("/v1/health")["pid"]
    blocker = home / "jobs" / str(job) / "run-1" / f".desired.json.{pid}.tmp"
    blocker.mkdir()                   # every write of desired.json now fails; it still reads "running"
    assert daemon.cli("pause", str(job), "--to", "ram").returncode == 0
    daemon.until(job, lambda j: "failed to update what its supervisor is asked" in (j["reason"] or ""))
    failing_since = time.monotonic()
    while time.monotonic() - failing_since < 2 * PAUSE_TIMEOUT_S:       # well past the timeout, undelivered
        j = daemon.job(job)
        assert j["state"] == "PAUSING", j          # not given up on: no "cannot park"
        time.sleep(0.5)
    blocker.rmdir()                   # the disk has room again: the request reaches the job
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    j = daemon.job(job)
    assert not any(e["kind"] == "cannot_park" for e in j["events"]), j["events"]
    assert daemon.cli("resume", str(job)).returncode == 0
    gate.open()
    daemon.state(job, "COMPLETED", timeout=120)
    assert json.loads((home / "t.json").read_text())["sha256"] == reference_hashes(steps)
