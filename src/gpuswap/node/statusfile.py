"""What a supervisor writes for the daemon: `status.json`, and its own lines in `supervisor.log`.

Kept apart from the supervisor's decisions because both must survive what the job does to the
disk and to the channel: a full disk keeps the job running and the write is retried (the old
file stays whole: fsutil), a job may send thousands of valid usage reports a second (each write
is an fsync, so they are held back), and a job reconnecting to send junk must not fill the disk
with complaints about it.
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


class StatusFile:
    """status.json as the supervisor keeps it (`status`, changed under `lock`, written whole) and
    supervisor.log beside it."""

    def __init__(self, run_dir: Path, status: SupervisorStatus, lock: threading.RLock) -> None:
        self.run_dir, self.status, self.lock = run_dir, status, lock
        self._unsaved = False         # status changed (or a write failed) and is not on disk yet
        self._written_at = 0.0        # monotonic time of the last status.json write
        self._write_failed = False    # said once in supervisor.log until a write succeeds again
        self._complaints = 0

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
            return True

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

    def log_limited(self, text: str) -> None:
        """A job reconnecting to send junk must not fill the disk with our complaints."""
        self._complaints += 1
        if self._complaints <= MAX_COMPLAINTS:
            self.log(text + (" (no more such lines)" if self._complaints == MAX_COMPLAINTS else ""))
