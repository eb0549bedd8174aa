"""A job's control messages are untrusted: hostile ones cost that job, never the scheduler.

Issue 10 item 2: one usage report of 10**30 bytes made every controller tick fail (SQLite INTEGER
is 64-bit), so other users' jobs stayed PENDING with GPUs free, cancels were never applied, and
it survived a restart. Here a real job sends hostile lines over its real control socket; and a
status.json as an older supervisor would have written it (values straight from the job), or
one that cannot be read at all, is left for a restarted daemon to find.
"""
from __future__ import annotations

import json
import os
import pwd
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuswap.fsutil import atomic_write_bytes, atomic_write_json
from gpuswap.node.jobchannel import MAX_BAD
from gpuswap_testing import AsUser

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a second user's job (nobody)")
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hostile_job  # noqa: E402

TWO_GPUS = ("--simulate-gpus", "2x80GiB", "--min-runtime", "1")


def as_nobody(home: Path, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
    """One API request as `nobody` (a genuinely other SO_PEERCRED): (status, body)."""
    pw = pwd.getpwnam("nobody")
    return AsUser(pw.pw_uid, pw.pw_gid).api(home, method, path, body)


def others_job_runs_and_cancels_apply(daemon, victim: int, failures_logged: int = 0) -> None:
    """The scheduler still works for everyone: nobody's job starts on the free GPU, root's cancel
    of the bad job is applied, and a restarted daemon comes up clean and keeps both outcomes."""
    code, rec = as_nobody(daemon.home, "POST", "/v1/jobs", {"argv": ["sleep", "600"], "cwd": "/tmp",
                                                            "env": {"PATH": os.environ["PATH"]}})
    assert code == 201, rec
    other = rec["id"]
    j = daemon.state(other, "RUNNING")
    assert j["user"] == "nobody" and j["assigned_gpus"] == [1], j
    r = daemon.cli("cancel", str(victim))
    assert r.returncode == 0, r.stderr
    daemon.state(victim, "CANCELLED")
    daemon.stop()
    daemon.start()
    assert daemon.job(victim)["state"] == "CANCELLED"
    assert daemon.state(other, "RUNNING")["assigned_gpus"] == [1]
    assert as_nobody(daemon.home, "POST", f"/v1/jobs/{other}/cancel")[0] == 200
    daemon.state(other, "CANCELLED")
    out = (daemon.home / "daemon.out").read_text()
    # A failure of one job's step is logged once (with its traceback), not on every tick.
    assert out.count("Traceback") == out.count(f"job {victim}: gpuswap failed") == failures_logged, out


def test_hostile_control_messages_cost_only_that_job(make_daemon, home):
    daemon = make_daemon(*TWO_GPUS)
    out = home / "hostile.json"
    job = daemon.submit([sys.executable, str(HERE / "hostile_job.py"), str(out)])
    run = home / "jobs" / str(job) / "run-1"
    # Every hostile line is rejected and counted: those on the job's connection (the attack is
    # also its last word) and MAX_BAD on the junk-only connection, which is then closed.
    want = len(hostile_job.HOSTILE) + 1 + MAX_BAD

    def rejected(_: Any) -> bool:
        try:
            return json.loads((run / "status.json").read_text())["runtime"].get("rejected", 0) >= want
        except (FileNotFoundError, ValueError, KeyError):
            return False
    daemon.until(job, rejected)
    st = json.loads((run / "status.json").read_text())
    assert st["runtime"]["rejected"] == want, st
    assert st["runtime"]["device_bytes"] == 2 << 30 and st["runtime"]["step"] == hostile_job.MARK_STEP, st
    # The valid report between the hostile ones is taken; nothing hostile reached the record.
    j = daemon.until(job, lambda j: j["step"] == hostile_job.MARK_STEP)
    assert j["state"] == "RUNNING" and j["device_bytes"] == 2 << 30 and j["runtime_attached"], j
    # The job writes its report after it sees the junk connection closed, which can come after
    # the supervisor counted the rejections: wait for the file, not for a moment.
    daemon.until(job, lambda _: out.exists())
    assert json.loads(out.read_text()) == {"sent": len(hostile_job.HOSTILE), "junk_connection_closed": True}
    log = (run / "supervisor.log").read_text()
    assert log.count("ignored an invalid control message") == 2, log   # once per connection
    assert log.count(f"closed a control connection after {MAX_BAD} invalid messages") == 1, log
    others_job_runs_and_cancels_apply(daemon, job)


@pytest.mark.parametrize("corruption", ["values from an older supervisor", "not JSON"])
def test_a_bad_status_file_costs_only_its_job(make_daemon, home, corruption):
    """What the daemon reads back is checked too (a supervisor still running an older version
    wrote what the job said), and a job whose status cannot be read at all is isolated."""
    daemon = make_daemon(*TWO_GPUS)
    job = daemon.submit(["sleep", "600"])     # no runtime: its supervisor rewrites nothing now
    daemon.state(job, "RUNNING")
    status = home / "jobs" / str(job) / "run-1" / "status.json"
    daemon.until(job, lambda _: status.exists() and json.loads(status.read_text())["job_pid"])
    daemon.kill9()
    st = json.loads(status.read_text())
    huge = 10**30
    if corruption == "not JSON":
        atomic_write_bytes(status, b'{"runtime": {"attached": tr')
    else:
        st["runtime"] = {"connected": True, "attached": True, "state": "running", "device_bytes": huge,
                         "step": -huge, "pid": huge, "pause_s": float("nan"), "error": "x" * 10**6,
                         "error_at": float("inf"), "bytes": "lots"}
        st["job_pid"] = huge
        atomic_write_json(status, st)
    daemon.start()
    if corruption == "not JSON":
        daemon.until(job, lambda j: any("gpuswap failed to observe it" in e["reason"] for e in j["events"]))
    else:
        j = daemon.until(job, lambda j: j["runtime_attached"])   # the valid fields are taken
        assert j["device_bytes"] == 0 and j["step"] is None, j
    others_job_runs_and_cancels_apply(daemon, job, failures_logged=1 if corruption == "not JSON" else 0)


def test_a_flood_of_valid_reports_costs_a_bounded_number_of_status_writes(make_daemon, home):
    """Valid messages are untrusted too: 100,000 usage reports as fast as a job can send them are
    folded into status.json at most every USAGE_WRITE_S (each write is an fsync that every job on
    the disk would wait behind), and the last report still lands."""
    import flood_job

    daemon = make_daemon(*TWO_GPUS)
    sent = home / "flood.sent"
    job = daemon.submit([sys.executable, str(HERE / "flood_job.py"), str(sent), "100000"])
    run = home / "jobs" / str(job) / "run-1"
    daemon.until(job, lambda _: (run / "status.json").exists() and
                 json.loads((run / "status.json").read_text())["runtime"].get("attached"))
    pid = json.loads((run / "status.json").read_text())["supervisor_pid"]

    def writes() -> int:   # write(2) calls the supervisor has made (its status.json, its log)
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("syscw:"):
                return int(line.split()[1])
        raise AssertionError("no syscw in /proc/PID/io")

    before = writes()
    daemon.until(job, lambda _: sent.exists())
    j = daemon.until(job, lambda j: j["step"] == flood_job.LAST_STEP)
    assert j["device_bytes"] == 3 << 30 and j["state"] == "RUNNING", j
    # One write per report would be 100,000; two a second for as long as the flood lasts is far below.
    assert writes() - before < 2000, writes() - before
    daemon.cli("cancel", str(job))
    daemon.state(job, "CANCELLED")
