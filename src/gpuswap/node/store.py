"""The daemon's durable state: jobs, their events and the scheduler's decisions, in SQLite (WAL).

Every write commits (fsync, synchronous=FULL) before the caller acknowledges anything, so a
`kill -9` of the daemon at any instant loses nothing that a client was told. One connection,
guarded by a lock: the API's worker threads and the controller share it; our write rate is far
below what one connection serves.
"""
from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Optional

from gpuswap.jobs import JobState

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    argv TEXT NOT NULL,
    cwd TEXT NOT NULL,
    env TEXT NOT NULL,
    priority INTEGER NOT NULL,
    gpus INTEGER NOT NULL,
    mem_bytes INTEGER NOT NULL,
    preemptible INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    signal INTEGER,
    submit_time REAL NOT NULL,
    state_since REAL NOT NULL,
    last_start REAL,
    end_time REAL,
    attained_gpu_s REAL NOT NULL DEFAULT 0,
    run_s REAL NOT NULL DEFAULT 0,
    switch_s REAL NOT NULL DEFAULT 0,
    assigned TEXT NOT NULL DEFAULT '[]',
    home_gpus TEXT NOT NULL DEFAULT '[]',
    parked TEXT,
    parked_bytes INTEGER NOT NULL DEFAULT 0,
    device_bytes INTEGER NOT NULL DEFAULT 0,
    generation INTEGER NOT NULL DEFAULT 0,
    desired TEXT NOT NULL DEFAULT 'running',
    desired_tier TEXT,
    pause_requested_at REAL,
    hold INTEGER NOT NULL DEFAULT 0,
    no_runtime INTEGER NOT NULL DEFAULT 0,
    stopped INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    step INTEGER,
    pause_mode TEXT NOT NULL DEFAULT 'auto',
    mechanism TEXT,
    attached INTEGER NOT NULL DEFAULT 0,
    transparent_refused TEXT,
    abort_reason TEXT,
    ram_allowance INTEGER,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_version ON jobs(version);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    time REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    initiator TEXT          -- who asked for a pause or spill: 'policy' | 'user' (NULL otherwise)
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    user TEXT PRIMARY KEY,
    gpu_s REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS bandwidths (
    field TEXT PRIMARY KEY,
    bytes_per_s REAL NOT NULL,
    samples INTEGER NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    hash TEXT NOT NULL,
    created REAL NOT NULL,
    created_by TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT ''
);
"""

_JSON_COLUMNS = {"argv", "env", "assigned", "home_gpus"}
# Every column but `env`: a job's environment (kilobytes) is read only when it is launched.

_BOOL_COLUMNS = {"preemptible", "hold", "no_runtime", "stopped", "cancel_requested", "attached"}


@dataclass
class JobRecord:
    """One row of `jobs`, typed. Field names are the column names."""

    id: int
    name: str
    user: str
    uid: int
    gid: int
    argv: list[str]
    cwd: str
    priority: int
    gpus: int
    mem_bytes: int
    preemptible: bool
    state: JobState
    reason: str
    exit_code: Optional[int]
    signal: Optional[int]
    submit_time: float
    state_since: float
    last_start: Optional[float]
    end_time: Optional[float]
    attained_gpu_s: float
    run_s: float
    switch_s: float
    assigned: list[int]
    home_gpus: list[int]
    parked: Optional[str]
    parked_bytes: int
    device_bytes: int
    generation: int
    desired: str
    desired_tier: Optional[str]
    pause_requested_at: Optional[float]
    hold: bool
    no_runtime: bool
    stopped: bool
    cancel_requested: bool
    preemptions: int
    step: Optional[int]
    pause_mode: str          # auto | cooperative | transparent, as submitted
    mechanism: Optional[str]  # how the current/last park is done: cooperative | transparent
    attached: bool           # its gpuswap runtime said hello
    transparent_refused: Optional[str]  # why the driver path cannot park this job, once found out
    abort_reason: Optional[str]  # the daemon is stopping the job because of this; it ends FAILED
    ram_allowance: Optional[int]  # most bytes its RAM park may take (what the budget has left)
    version: int             # store-wide change counter at this row's last write

    @property
    def holds_gpu(self) -> bool:
        """Its memory is on its GPUs: started and not parked (a SIGSTOPped job still holds it)."""
        if self.state in (JobState.RUNNING, JobState.PAUSING, JobState.RESUMING):
            return True
        return self.state == JobState.PAUSED and self.stopped and self.parked is None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "JobRecord":
        values = list(row)
        for i in _JSON_INDEXES:
            v = values[i]
            values[i] = [] if v == "[]" else json.loads(v)   # '[]' is most rows' GPU lists
        for i in _BOOL_INDEXES:
            values[i] = bool(values[i])
        values[_STATE_INDEX] = JobState(values[_STATE_INDEX])
        return cls(*values)


_RECORD_FIELDS = [f.name for f in fields(JobRecord)]
_RECORD_COLUMNS = ", ".join(_RECORD_FIELDS)
_JSON_INDEXES = [i for i, n in enumerate(_RECORD_FIELDS) if n in _JSON_COLUMNS]
_BOOL_INDEXES = [i for i, n in enumerate(_RECORD_FIELDS) if n in _BOOL_COLUMNS]
_STATE_INDEX = _RECORD_FIELDS.index("state")


@dataclass(frozen=True)
class Event:
    time: float
    state: str
    reason: str


@dataclass
class NewJob:
    name: str
    user: str
    uid: int
    gid: int
    argv: list[str]
    cwd: str
    env: dict[str, str]
    priority: int
    gpus: int
    mem_bytes: int
    preemptible: bool = True
    pause_mode: str = "auto"


def _encode(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS:
        return json.dumps(value)
    if column in _BOOL_COLUMNS:
        return int(bool(value))
    if isinstance(value, JobState):
        return value.value
    return value


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(SCHEMA)
        if "initiator" not in {r[1] for r in self._db.execute("PRAGMA table_info(events)")}:
            self._db.execute("ALTER TABLE events ADD COLUMN initiator TEXT")   # a home made before it
        self._version = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM jobs").fetchone()[0]

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- jobs -------------------------------------------------------------------------------
    def add_jobs(self, jobs: Iterable[NewJob], now: float) -> list[int]:
        """Insert jobs and their PENDING events in one transaction (one fsync for a batch)."""
        ids: list[int] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for j in jobs:
                    cur = self._db.execute(
                        "INSERT INTO jobs (name,user,uid,gid,argv,cwd,env,priority,gpus,mem_bytes,"
                        "preemptible,pause_mode,state,reason,submit_time,state_since,version) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (j.name, j.user, j.uid, j.gid, json.dumps(j.argv), j.cwd, json.dumps(j.env),
                         j.priority, j.gpus, j.mem_bytes, int(j.preemptible), j.pause_mode,
                         JobState.PENDING.value, "submitted", now, now, self._next_version()),
                    )
                    jid = int(cur.lastrowid)
                    self._db.execute(
                        "INSERT INTO events (job_id,time,state,reason) VALUES (?,?,?,?)",
                        (jid, now, JobState.PENDING.value, "submitted"),
                    )
                    ids.append(jid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return ids

    def get(self, job_id: int) -> Optional[JobRecord]:
        with self._lock:
            row = self._db.execute(f"SELECT {_RECORD_COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRecord.from_row(row) if row else None

    def env(self, job_id: int) -> dict[str, str]:
        """The environment the job was submitted with (needed only to launch it)."""
        with self._lock:
            row = self._db.execute("SELECT env FROM jobs WHERE id=?", (job_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def list(self, user: Optional[str] = None, live_only: bool = False,
             states: Optional[Iterable[JobState]] = None) -> list[JobRecord]:
        sql, args = f"SELECT {_RECORD_COLUMNS} FROM jobs", []
        where = []
        if user is not None:
            where.append("user=?")
            args.append(user)
        if live_only:
            where.append("state NOT IN ('COMPLETED','FAILED','CANCELLED')")
        if states is not None:
            wanted = [s.value for s in states]
            where.append(f"state IN ({','.join('?' * len(wanted))})")
            args.extend(wanted)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id"
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    def update(self, job_id: int, now: float, event: Optional[str] = None, initiator: Optional[str] = None,
               **changes: Any) -> None:
        """Change columns of a job; with `event`, also record a state event, atomically.

        The event's state is the job's state after the change; `initiator` ('policy' or 'user')
        says who asked for the pause or spill it records (for metrics, not read back from text).
        """
        if not changes and event is None:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if "state" in changes:
                    changes.setdefault("state_since", now)
                changes["version"] = self._next_version()
                if changes:
                    cols = ", ".join(f"{k}=?" for k in changes)
                    self._db.execute(
                        f"UPDATE jobs SET {cols} WHERE id=?",
                        [_encode(k, v) for k, v in changes.items()] + [job_id],
                    )
                if event is not None:
                    state = self._db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()[0]
                    self._db.execute(
                        "INSERT INTO events (job_id,time,state,reason,initiator) VALUES (?,?,?,?,?)",
                        (job_id, now, state, event, initiator),
                    )
                    if "reason" not in changes:
                        self._db.execute("UPDATE jobs SET reason=? WHERE id=?", (event, job_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def add_event(self, job_id: int, now: float, state: JobState, text: str) -> None:
        """Record an event that changes nothing about the job (why it waits): its row, its `reason`
        (the last transition's) and its version stay as they are."""
        with self._lock:
            self._db.execute("INSERT INTO events (job_id,time,state,reason) VALUES (?,?,?,?)",
                             (job_id, now, state.value, text))

    def accrue(self, rows: list[tuple[int, float, float, float]]) -> None:
        """Add (attained_gpu_s, run_s, switch_s) deltas to many jobs in one transaction."""
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "UPDATE jobs SET attained_gpu_s=attained_gpu_s+?, run_s=run_s+?, switch_s=switch_s+?, "
                "version=? WHERE id=?",
                [(a, r, s, self._next_version(), jid) for jid, a, r, s in rows],
            )
            self._db.execute("COMMIT")

    def changed_since(self, version: int) -> list[JobRecord]:
        """Jobs written after `version` (an informer's incremental read), oldest change first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_RECORD_COLUMNS} FROM jobs WHERE version > ? ORDER BY version", (version,)
            ).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    def events(self, job_id: int) -> list[Event]:
        with self._lock:
            rows = self._db.execute(
                "SELECT time,state,reason FROM events WHERE job_id=? ORDER BY id", (job_id,)
            ).fetchall()
        return [Event(r["time"], r["state"], r["reason"]) for r in rows]

    def record_decision(self, now: float, kind: str, job_id: int, detail: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO decisions (time,kind,job_id,detail) VALUES (?,?,?,?)",
                (now, kind, job_id, json.dumps(detail)),
            )

    # -- fair-share usage -------------------------------------------------------------------
    def load_usage(self) -> dict[str, float]:
        with self._lock:
            return {r["user"]: r["gpu_s"] for r in self._db.execute("SELECT user,gpu_s FROM usage")}

    def save_usage(self, usage: dict[str, float], now: float) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO usage (user,gpu_s,updated) VALUES (?,?,?) "
                "ON CONFLICT(user) DO UPDATE SET gpu_s=excluded.gpu_s, updated=excluded.updated",
                [(u, v, now) for u, v in usage.items()],
            )
            self._db.execute("COMMIT")

    # -- switch-cost bandwidths learned from real moves (node/bandwidth.py) ----------------
    def load_bandwidths(self) -> dict[str, tuple[float, int]]:
        """field -> (bytes/s, real moves folded in), as last saved."""
        with self._lock:
            rows = self._db.execute("SELECT field,bytes_per_s,samples FROM bandwidths").fetchall()
        return {r["field"]: (float(r["bytes_per_s"]), int(r["samples"])) for r in rows}

    def save_bandwidth(self, field: str, bytes_per_s: float, samples: int, now: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO bandwidths (field,bytes_per_s,samples,updated) VALUES (?,?,?,?) "
                "ON CONFLICT(field) DO UPDATE SET bytes_per_s=excluded.bytes_per_s, "
                "samples=excluded.samples, updated=excluded.updated",
                (field, bytes_per_s, samples, now))

    # -- API tokens (only their sha256 is stored) and the event log for metrics -------------
    def add_token(self, token_id: str, user: str, uid: int, digest: str, now: float, created_by: str,
                  note: str = "") -> None:
        with self._lock:
            self._db.execute("INSERT INTO tokens (id,user,uid,hash,created,created_by,note) VALUES (?,?,?,?,?,?,?)",
                             (token_id, user, uid, digest, now, created_by, note))

    def tokens(self, token_id: Optional[str] = None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM tokens", []
        if token_id is not None:
            sql, args = sql + " WHERE id=?", [token_id]
        with self._lock:
            return [dict(r) for r in self._db.execute(sql + " ORDER BY created", args).fetchall()]

    def delete_token(self, token_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM tokens WHERE id=?", (token_id,)).rowcount > 0

    def events_after(self, after_id: int, limit: int = 10000) -> list[tuple[int, int, float, str, str, Optional[str]]]:
        """(id, job_id, time, state, reason, initiator) of events past `after_id`, oldest first: the
        table only grows."""
        with self._lock:
            rows = self._db.execute("SELECT id,job_id,time,state,reason,initiator FROM events WHERE id>? "
                                    "ORDER BY id LIMIT ?",
                                    (after_id, limit)).fetchall()
        return [tuple(r) for r in rows]  # type: ignore[misc]
