"""What a supervisor writes for the daemon: `status.json`, and its own lines in `supervisor.log`.

Kept apart from the supervisor's decisions because both must survive what the job does to the
disk and to the channel: a full disk keeps the job running and the write is retried (the old
file stays whole: fsutil), a job may send thousands of valid usage reports a second (each write
is an fsync, so they are held back), and a job reconnecting to send junk must not fill the disk
with complaints about it. Nor may a job that reconnects and says hello in a loop (each hello is
valid, and answered) make root fsync status.json and log a line thousands of times a second: what
a job's messages cause is paced (`Bucket`), with room for a large job's bursts.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

from gpuswap.fsutil import atomic_write_json, make_file
from gpuswap.protocol import rundir
from gpuswap.protocol.status import SupervisorStatus

MAX_COMPLAINTS = 20   # supervisor.log lines about invalid control messages, for the supervisor's whole life
USAGE_WRITE_S = 0.5   # usage reports reach status.json at most this often
JOB_WRITES_BURST = 4096   # status.json writes a job's messages cause at once (a park of 1,024 ranks)...
JOB_LINES_BURST = 200     # ... and supervisor.log lines; then one per USAGE_WRITE_S / PACED_LINE_S
PACED_LINE_S = 1.0


class Bucket:
    """A token bucket: `burst` at once, then one per `every_s`. What a job's messages make its
    supervisor do is bounded by this, however fast the job sends."""

    def __init__(self, burst: int, every_s: float) -> None:
        self.burst, self.every_s = burst, every_s
        self._tokens, self._at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.every_s)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class StatusFile:
    """status.json as the supervisor keeps it (`status`, changed under `lock`, written whole) and
    supervisor.log beside it."""

    def __init__(self, run_dir: Path, status: SupervisorStatus, lock: threading.RLock) -> None:
        self.run_dir, self.status, self.lock = run_dir, status, lock
        self._unsaved = False         # status changed (or a write failed) and is not on disk yet
        self._written_at = 0.0        # monotonic time of the last status.json write
        self._write_failed = False    # said once in supervisor.log until a write succeeds again
        self._complaints = 0
        self._job_writes = Bucket(JOB_WRITES_BURST, USAGE_WRITE_S)
        self._job_lines = Bucket(JOB_LINES_BURST, PACED_LINE_S)
        self._lines_dropped = 0
        self.writes = 0               # status.json writes done (for the tests and the curious)

    def write(self) -> bool:
        """Write status.json; on a full disk keep the job running and retry from the main loop
        (the old file stays whole, and no temp file is left: fsutil)."""
        with self.lock:
            try:
                atomic_write_json(self.run_dir / rundir.STATUS, self.status.to_json())
            except OSError as e:
                if not self._write_failed:
                    self.log(f"cannot write status.json ({e.strerror or e}); retrying")
                self._unsaved = self._write_failed = True
                return False
            self._unsaved = self._write_failed = False
            self._written_at = time.monotonic()
            self.writes += 1
            return True

    def write_for_job(self) -> None:
        """A write a job's message asks for: now while the job's budget lasts (no job that keeps
        to the protocol exhausts it), else held back to the next due write (`due`), which the
        main loop makes within USAGE_WRITE_S: nothing is lost, only delayed."""
        with self.lock:
            if self._job_writes.take():
                self.write()
            else:
                self.hold_back()

    def hold_back(self) -> None:
        """A change (a usage report, a rejection count) folded into the next write rather than
        written now: one counted after the last write would otherwise never reach status.json."""
        self._unsaved = True

    def due(self) -> bool:
        """Whether a held-back change (or a failed write) should be written now."""
        return self._unsaved and time.monotonic() - self._written_at >= USAGE_WRITE_S

    def log(self, text: str) -> None:
        path = self.run_dir / rundir.SUPERVISOR_LOG
        try:
            if not path.exists():
                make_file(path, 0o600)
            with open(path, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        except OSError:
            pass    # a full disk must not take the job's supervisor down with it

    def log_paced(self, text: str) -> None:
        """A line a job's messages cause (an order sent in answer to its hello): paced, with the
        count of lines left out said on the next one written."""
        with self.lock:
            if not self._job_lines.take():
                self._lines_dropped += 1
                return
            dropped, self._lines_dropped = self._lines_dropped, 0
        self.log(text + (f" ({dropped} such lines before this one not logged: too many too fast)" if dropped else ""))

    def log_limited(self, text: str) -> None:
        """A job reconnecting to send junk must not fill the disk with our complaints."""
        self._complaints += 1
        if self._complaints <= MAX_COMPLAINTS:
            self.log(text + (" (no more such lines)" if self._complaints == MAX_COMPLAINTS else ""))
