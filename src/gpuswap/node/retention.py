"""Forgetting finished jobs after `--retention` (default 30 days): their database rows (record,
argv, events, decisions) and their `jobs/ID` directory (output.log, run dirs, checkpoints), in a
pool on the node that ran them (its agent deletes them there).

Without it the state grew for ever (59 MB of directories for 2,500 trivial jobs). The sweep runs
on its own thread in small batches, so the controller and the API never wait on it, and it never
touches a live job: it only picks jobs whose state is final, skips any whose supervisor still
holds a run lock, and the row delete itself re-checks the state. The directory goes first and the
rows second, so a daemon killed in between leaves a row the next sweep finishes, never an orphan.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Optional

from gpuswap.node.launcher import Launcher
from gpuswap.node.pool import Pool
from gpuswap.node.store import Store

log = logging.getLogger("gpuswap.retention")

DEFAULT_RETENTION = "30d"
BATCH = 100
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> Optional[float]:
    """'30d', '12h', '90m', '45s', '2w' or plain seconds -> seconds; 'never' -> None (keep all)."""
    t = text.strip().lower()
    if t in ("never", "forever", "off"):
        return None
    m = re.fullmatch(r"(\d{1,9}(?:\.\d{1,6})?)\s*([smhdw]?)", t)
    if not m:
        raise ValueError(f"cannot read {text!r} as a duration; write e.g. 30d, 12h, 90m, 45s or never")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


class RetentionSweeper:
    """A daemon thread that, every `interval_s`, forgets jobs that ended over `retention_s` ago."""

    def __init__(self, store: Store, launcher: Launcher, retention_s: float,
                 clock: Callable[[], float] = time.time, pool: Optional[Pool] = None):
        self.store, self.launcher, self.retention_s, self.clock = store, launcher, retention_s, clock
        self.pool = pool              # a pool's jobs' files are on their nodes
        self.interval_s = min(3600.0, max(1.0, retention_s / 10))
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:    # a failed sweep (disk error, locked db) is retried next interval
                log.exception("retention sweep failed")
            self._stop.wait(self.interval_s)

    def sweep(self) -> int:
        """Forget every expired finished job, a batch at a time; returns how many."""
        forgotten, skipped = 0, set()
        while not self._stop.is_set():
            ids = [i for i in self.store.expired(self.clock() - self.retention_s, BATCH + len(skipped))
                   if i not in skipped][:BATCH]
            if not ids:
                break
            for job_id in ids:
                if not self._forget_files(job_id):   # a supervisor still runs, or its node is away
                    skipped.add(job_id)
                    continue
                forgotten += self.store.delete_finished(job_id)
            time.sleep(0.01)     # let the API and the controller have the store between batches
        if forgotten:
            log.info("retention: forgot %d job(s) that ended over %gs ago", forgotten, self.retention_s)
        return forgotten

    def _forget_files(self, job_id: int) -> bool:
        """Its files deleted where they are: here, or on its pool node (through its agent). False
        while a supervisor of it still runs (it should not, once final) or its node is not in the
        pool now: the record stays, so the files are not orphaned, and the next sweep tries again."""
        if self.pool is None or self.pool.single:
            return self.launcher.forget(job_id)
        job = self.store.get(job_id)
        if job is None or job.node is None:      # never placed: nothing on any node
            return self.launcher.forget(job_id)
        try:
            return self.pool.on(job.node).forget(job_id)
        except Exception:
            return False
