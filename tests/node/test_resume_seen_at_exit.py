"""A resume the daemon never saw while it lasted is still recorded (node/observe.py).

A job restarted from disk can restore and exit between two of the daemon's ticks (a loaded
machine, a job with one step left). Its last facts say what the restore did, so the record must
show the restart, not only "exited with code 0 while resuming". The daemon is held with SIGSTOP
over the whole resume, so the test does not race it."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from gpuswap.node.store import Store

HERE = Path(__file__).resolve().parent


def _wait(what: str, fact, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not fact():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _status(home: Path, job: int, generation: int) -> dict:
    try:
        return json.loads((home / "jobs" / str(job) / f"run-{generation}" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_restart_from_disk_recorded_when_the_job_exits_before_the_daemon_looks(daemon, home):
    gate = home / "restart.go"
    job = daemon.submit([sys.executable, str(HERE / "restore_then_exit_job.py"), str(gate)], name="quick")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert daemon.cli("resume", str(job)).returncode == 0
    # The restarted job is running (held at the gate, not attached yet), read from the files the
    # daemon and the supervisor keep, since the daemon is about to be stopped.
    store = Store(home / "state.db")
    try:
        rec = None

        def relaunched() -> bool:
            nonlocal rec
            rec = store.get(job)
            return rec is not None and rec.generation >= 2 and bool(_status(home, job, rec.generation).get("job_pid"))
        _wait("the restart never launched", relaunched)
    finally:
        store.close()
    assert daemon.job(job)["state"] == "RESUMING"     # it cannot attach before the gate opens
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        gate.touch()
        _wait("the restarted job never exited", lambda: _status(home, job, rec.generation).get("exit") is not None)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    done = daemon.state(job, "COMPLETED", "FAILED")
    reasons = [e["reason"] for e in done["events"]]
    assert done["state"] == "COMPLETED", reasons
    restarted = [i for i, r in enumerate(reasons) if r.startswith("restarted from its disk checkpoint at step ")]
    assert len(restarted) == 1 and restarted[0] == len(reasons) - 2, reasons
    assert reasons[-1] == "exited with code 0", reasons
