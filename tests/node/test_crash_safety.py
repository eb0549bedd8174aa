"""kill -9 of the daemon at any moment loses no job, no exit code, no parked state."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from gpuswap.jobs import JobState
from gpuswap.lifecycle import EventKind, NewEvent
from gpuswap.node.store import Store
from gpuswap_testing import Gate, forever


def _status(home, job: int) -> dict:
    path = home / "jobs" / str(job) / "run-1" / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _until_status(home, job: int, key: str, timeout: float = 180) -> dict:
    """The run's status.json once the supervisor has recorded `key` (job_pid: spawned; exit: ended)."""
    deadline = time.monotonic() + timeout
    while not _status(home, job).get(key):
        assert time.monotonic() < deadline, (key, _status(home, job))
        time.sleep(0.05)
    return _status(home, job)


def test_exit_code_of_job_that_ends_while_daemon_is_down(daemon, home):
    gate = Gate(home / "go")
    job = daemon.submit(gate.hold("raise SystemExit(7)"))
    _until_status(home, job, "job_pid")    # spawned (RUNNING is recorded before the spawn)
    daemon.kill9()
    gate.open()
    _until_status(home, job, "exit")       # the job ended with nobody but its supervisor watching
    daemon.start()
    j = daemon.state(job, "FAILED", timeout=20)
    assert j["exit_code"] == 7


def test_job_that_ends_while_daemon_is_down_keeps_its_real_end_time(daemon, home):
    """end_time and the final event are when the job ended (the supervisor's exit.time), not
    when the restarted daemon noticed."""
    gate = Gate(home / "go")
    job = daemon.submit(gate.hold())
    _until_status(home, job, "job_pid")    # spawned, not just recorded
    daemon.kill9()
    opened = time.time()
    gate.open()
    ended = _until_status(home, job, "exit")["exit"]["time"]
    assert opened <= ended <= time.time()  # the supervisor's record of when it ended
    time.sleep(3)                          # the daemon stays down well after the job ended (a lower bound)
    restarted = time.time()
    daemon.start()
    j = daemon.state(job, "COMPLETED", timeout=20)
    assert abs(j["end_time"] - ended) < 1.0 and restarted - j["end_time"] > 2, (j["end_time"], ended, restarted)
    last = j["events"][-1]
    assert last["state"] == "COMPLETED" and abs(last["time"] - ended) < 1.0
    assert abs(j["state_since"] - ended) < 1.0


def test_running_job_is_readopted_not_restarted(daemon, home):
    gate = Gate(home / "go")             # the job outlives the restart however slow it is
    job = daemon.submit(gate.hold(before="print('started', flush=True)", then="print('finished')"))
    daemon.state(job, "RUNNING")
    daemon.kill9()
    daemon.start()
    assert daemon.job(job)["state"] == "RUNNING"
    gate.open()
    j = daemon.state(job, "COMPLETED", timeout=30)
    log = daemon.cli("logs", str(job)).stdout
    assert log.count("started") == 1 and "finished" in log      # one process, never relaunched
    assert [e["state"] for e in j["events"]] == ["PENDING", "RUNNING", "COMPLETED"]


def test_parked_in_ram_survives_daemon_kill_and_resumes_exactly(daemon, home, reference_hashes):
    steps = 150
    long_gate, urgent_gate = Gate(home / "long.go"), Gate(home / "urgent.go")
    long_id = daemon.submit(long_gate.train(home / "long.json", steps), name="long", priority="low")
    daemon.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 10)
    urgent = daemon.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    daemon.until(long_id, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    long_gate.open()
    daemon.state(urgent, "RUNNING")
    daemon.kill9()
    time.sleep(1)
    daemon.start()
    j = daemon.job(long_id)
    assert j["state"] == "PAUSED" and j["parked"] == "ram"   # the urgent job still holds the GPU
    urgent_gate.open()
    daemon.state(urgent, "COMPLETED", timeout=30)
    daemon.state(long_id, "COMPLETED", timeout=120)
    assert json.loads((home / "long.json").read_text())["sha256"] == reference_hashes(steps)


def test_a_spill_the_api_recorded_before_a_kill_is_made_after_the_restart(daemon, home, reference_hashes):
    """The API records only a user's intent (hold and the tier asked for); the controller turns it
    into the spill. A daemon killed between the two finds the intent in its database and spills."""
    steps = 150
    gate = Gate(home / "s.go")        # it cannot finish before it was parked, spilled and resumed
    job = daemon.submit(gate.train(home / "s.json", steps, 0.03), name="s")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert daemon.cli("pause", str(job), "--to", "ram").returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    daemon.kill9()
    store = Store(home / "state.db")  # exactly what `pause --to disk` writes, and nothing of the controller's
    store.update(job, time.time(), hold=True, hold_tier="disk", event=NewEvent(
        EventKind.PAUSE_REQUESTED, "spill to disk requested by test", tier="disk", initiator="user"))
    before = store.get(job)
    store.close()
    assert (before.state, before.parked, before.desired_tier) == (JobState.PAUSED, "ram", "ram")
    daemon.start()
    j = daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    asked = [(e["kind"], e["tier"], e["initiator"]) for e in j["events"] if e["kind"] in ("pause_requested",
                                                                                          "spill_requested")]
    assert asked[-2:] == [("pause_requested", "disk", "user"), ("spill_requested", "disk", "user")], j["events"]
    assert daemon.cli("resume", str(job)).returncode == 0
    gate.open()
    daemon.state(job, "COMPLETED", timeout=120)
    assert json.loads((home / "s.json").read_text())["sha256"] == reference_hashes(steps)


def test_repeated_kills_during_a_busy_queue_lose_nothing(daemon):
    ids = [daemon.submit(["sh", "-c", f"sleep 0.{i}; exit {i}"], priority=p)
           for i, p in zip(range(6), ["low", "urgent", "normal", "high", "low", "urgent"])]
    for _ in range(4):
        time.sleep(0.7)
        daemon.kill9()
        daemon.start()
    for i, job in enumerate(ids):
        j = daemon.state(job, "COMPLETED", "FAILED", timeout=60)
        assert j["exit_code"] == i


def test_supervisor_survives_and_pid_reuse_cannot_fool_liveness(daemon, home):
    job = daemon.submit(forever(home))
    daemon.state(job, "RUNNING")
    path = home / "jobs" / str(job) / "run-1" / "status.json"
    deadline = time.monotonic() + 180
    while not (path.exists() and json.loads(path.read_text())["job_pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    status = json.loads(path.read_text())
    daemon.kill9()
    os.kill(status["supervisor_pid"], signal.SIGKILL)   # the supervisor dies too: status unknown
    daemon.start()
    j = daemon.state(job, "FAILED", timeout=20)
    assert "supervisor died" in j["reason"]
    try:                                                # it died with its supervisor (test_orphans.py)
        assert open(f"/proc/{status['job_pid']}/stat").read().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        pass


def _lock_free(path) -> bool:
    import fcntl
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_start_the_daemon_died_before_spawning_is_spawned_after_restart(daemon, home):
    """Starting a job is: record RUNNING, write the run's spec.json, spawn its supervisor. A daemon
    killed between the last two leaves a RUNNING job with a spec and no process. Rebuild exactly
    that on disk (kill the supervisor and the job, remove what they and the spawn wrote), restart:
    the job is spawned then and runs once, rather than being failed as 'its supervisor died'."""
    gate = Gate(home / "go")       # the first run cannot end (and be recorded) before it is killed
    job = daemon.submit(gate.hold("print('ran')"))
    run = home / "jobs" / str(job) / "run-1"
    deadline = time.monotonic() + 180
    _until_status(home, job, "job_pid")
    daemon.kill9()
    st = json.loads((run / "status.json").read_text())
    for pid in (st["job_pid"], st["supervisor_pid"]):      # each leads its own session
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while not _lock_free(run / "lock") and time.monotonic() < deadline:
        time.sleep(0.05)
    for name in ("status.json", "spawned.json"):
        (run / name).unlink(missing_ok=True)
    (home / "jobs" / str(job) / "output.log").write_text("")
    assert (run / "spec.json").exists()
    daemon.start()
    gate.open()
    j = daemon.state(job, "COMPLETED", timeout=25)
    assert daemon.cli("logs", str(job)).stdout.count("ran") == 1
    assert [e["state"] for e in j["events"]] == ["PENDING", "RUNNING", "COMPLETED"]


def test_a_second_supervisor_of_a_generation_that_ran_starts_nothing(daemon, home):
    """A daemon killed after spawning a supervisor but before recording it spawns another after the
    restart; that one must not run the job a second time."""
    job = daemon.submit(["sh", "-c", "echo ran"])
    daemon.state(job, "COMPLETED")
    run = home / "jobs" / str(job) / "run-1"
    before = (run / "status.json").read_text()
    rc = subprocess.run([sys.executable, "-m", "gpuswap.node.supervisor", str(run)], timeout=180).returncode
    assert rc == 0
    assert (run / "status.json").read_text() == before
    assert daemon.cli("logs", str(job)).stdout.count("ran") == 1
