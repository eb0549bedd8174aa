"""A supervisor survives any desired.json (node/supervisor.py `read_desired`).

Only the daemon writes desired.json, but the supervisor holds a user's job: a directory, a FIFO
(whose open used to block the supervisor for good), a link, garbage, a field of the wrong type
("sigstop": "no" used to stop the job), a huge file (a 1 MiB one asking to cancel used to cancel
it) or no file at all is no new wish, said once in supervisor.log, and the job is left as it is.
The daemon is held with SIGSTOP meanwhile, so it cannot write its own record over the test's."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from gpuswap_testing import forever

RUNNING = ("R", "S", "D")      # alive and not stopped


def _wait(what: str, fact, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not fact():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _state(pid: int) -> str:
    """The process's state letter (Z: it died, and its parent has not reaped it), "gone" if none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _put(desired: Path, make) -> None:
    """Replace desired.json in one rename, so the supervisor never sees a version in between."""
    tmp = desired.with_name("desired.tmp")
    make(tmp)
    os.rename(tmp, desired)


def _text(data: str):
    return lambda p: p.write_text(data)


def test_any_unreadable_desired_json_is_no_wish_and_the_job_runs_on(daemon, home):
    job = daemon.submit(forever(home), name="held")
    daemon.state(job, "RUNNING")
    run = home / "jobs" / str(job) / "run-1"
    status = lambda: json.loads((run / "status.json").read_text())   # noqa: E731
    _wait("the job never started", lambda: (run / "status.json").exists() and status().get("job_pid"))
    sup, pid = status()["supervisor_pid"], status()["job_pid"]
    log, desired = run / "supervisor.log", run / "desired.json"
    ignored = lambda: [ln for ln in (log.read_text().splitlines() if log.exists() else [])   # noqa: E731
                       if "ignored desired.json" in ln]
    steps = [
        (_text("{not json"), "not JSON"),
        (_text('{"run": "running", "sigstop": "no"}'), "'sigstop' is a str"),
        (_text("[1, 2]"), "not a JSON object"),
        (_text('{"cancel": true, "pad": "' + "x" * (1 << 20) + '"}'), "larger than"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: os.symlink("/dev/zero", p), "Too many levels of symbolic links"),
    ]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        for n, (make, why) in enumerate(steps, 1):
            _put(desired, make)
            _wait(f"step {n} ({why}) never logged", lambda: len(ignored()) >= n or _state(sup) in ("Z", "gone"))
            assert _state(sup) in RUNNING, f"the supervisor died at step {n} ({why})"
            assert len(ignored()) == n and why in ignored()[-1], ignored()
        desired.unlink()
        _wait("its absence never logged", lambda: len(ignored()) == len(steps) + 1)
        assert "No such file or directory" in ignored()[-1], ignored()
        desired.mkdir()
        _wait("the directory never logged", lambda: len(ignored()) == len(steps) + 2)
        assert "not a regular file" in ignored()[-1], ignored()
        # The job and its supervisor are untouched: alive, not stopped, not cancelled.
        assert _state(sup) in RUNNING and _state(pid) in RUNNING, (_state(sup), _state(pid))
        assert status().get("exit") is None and status().get("stopped") is False
        desired.rmdir()
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert daemon.job(job)["state"] == "RUNNING"
    # The daemon writes its record again, and the supervisor still obeys it.
    assert daemon.cli("cancel", str(job)).returncode == 0
    done = daemon.state(job, "CANCELLED", "FAILED", "COMPLETED")
    assert done["state"] == "CANCELLED", [e["reason"] for e in done["events"]]
