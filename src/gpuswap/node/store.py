"""The daemon's durable state: jobs, their events and the scheduler's decisions, in SQLite (WAL).

Every write commits (fsync, synchronous=FULL) before the caller acknowledges anything, so a
`kill -9` of the daemon at any instant loses nothing that a client was told. One connection,
guarded by a lock: the API's worker threads and the controller share it; our write rate is far
below what one connection serves. The tables, and how an older database is brought up to them,
are node/schema.py's.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from gpuswap import lifecycle
from gpuswap.jobs import ENDED, JobState
from gpuswap.lifecycle import EventKind, IllegalTransition, NewEvent
from gpuswap.node import schema
from gpuswap.node.records import (RECORD_COLUMNS, RECORD_COLUMNS_NO_ARGV, RECORD_FROM, Event, EventRow, JobRecord,
                                  NewJob, encode)
from gpuswap.policy.estimate import RECENT

# the records are node/records.py's and lifecycle.py's, also named here
__all__ = ["Event", "EventRow", "IllegalTransition", "JobRecord", "NewEvent", "NewJob", "Store"]
_EVENT_INSERT = "INSERT INTO events (job_id,time,state,reason,initiator,kind,tier,mechanism) VALUES (?,?,?,?,?,?,?,?)"

_TERMINAL = tuple(sorted(ENDED))
_TERMINAL_SQL = "(" + ",".join(f"'{s}'" for s in _TERMINAL) + ")"
_ENDED = set(_TERMINAL) | {s for s in JobState if s.terminal}
# Runs of a family kept past the retention sweep: the predictor's window. A user's newest runs of
# any name are each among their own family's newest, so these serve both of its questions.
KEPT_RUNS = RECENT


def _wal(db: sqlite3.Connection, wait_s: float = 5.0) -> None:
    """Put the database in WAL mode (it stays so). Switching a new or rollback-journal file needs an
    exclusive lock that SQLite does not wait for (the statement already holds a read lock): when
    another opener is switching or migrating it at the same instant, try again, as long as
    busy_timeout would have waited."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode & 0xff != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.005)


class Store:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        try:
            self._db.execute("PRAGMA busy_timeout=5000")    # first: another opener may be migrating
            schema.refuse_newer(self._db, self.path)         # before anything writes to the file
            _wal(self._db)
            self._db.execute("PRAGMA synchronous=FULL")
            schema.migrate(self._db, self.path)
            self._version = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM jobs").fetchone()[0]
        except BaseException:
            self._db.close()
            raise

    def _next_version(self) -> int:
        self._version += 1
        return self._version

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- jobs -------------------------------------------------------------------------------
    def _rollback(self) -> None:
        """Undo the open transaction, if SQLite has not already (it does itself on some errors,
        e.g. a full disk, and a second ROLLBACK would hide that error behind its own)."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def add_jobs(self, jobs: Iterable[NewJob], now: float) -> list[int]:
        """Insert jobs and their PENDING events in one transaction (one fsync for a batch)."""
        ids: list[int] = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for j in jobs:
                    cur = self._db.execute(
                        "INSERT INTO jobs (name,user,uid,gid,cwd,priority,gpus,mem_bytes,"
                        "preemptible,pause_mode,state,reason,submit_time,state_since,version,"
                        "time_limit_s,estimate_s,estimate_from,estimate_runs) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (j.name, j.user, j.uid, j.gid, j.cwd,
                         j.priority, j.gpus, j.mem_bytes, int(j.preemptible), j.pause_mode,
                         JobState.PENDING.value, "submitted", now, now, self._next_version(),
                         j.time_limit_s, j.estimate_s, j.estimate_from, j.estimate_runs),
                    )
                    jid = int(cur.lastrowid)
                    argv = json.dumps(j.argv)
                    self._db.execute("INSERT INTO job_specs (job_id,argv,argv_bytes,env) VALUES (?,?,?,?)",
                                     (jid, argv, len(argv.encode("utf-8", "surrogatepass")), json.dumps(j.env)))
                    self._db.execute(_EVENT_INSERT, (jid, now, JobState.PENDING.value, "submitted", None,
                                                     EventKind.SUBMITTED.value, None, None))
                    lifecycle.check_record(self._record(jid))
                    ids.append(jid)
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return ids

    def _record(self, job_id: int) -> Optional[JobRecord]:
        """The row as the open transaction sees it, without its argv (the lifecycle checks read it)."""
        row = self._db.execute(f"SELECT {RECORD_COLUMNS_NO_ARGV} FROM jobs j WHERE j.id=?", (job_id,)).fetchone()
        return JobRecord.from_row(row) if row else None
    def finished_runs(self, uid: int, name: str, limit: int) -> tuple[list[float], list[float]]:
        """Run-seconds of the uid's last `limit` completed jobs of this name, and of any name,
        oldest first: what the runtime predictor learns from (policy/estimate.py). By uid, as
        listings are: an account made again under a deleted one's name learns nothing from the
        first one's runs. Jobs the retention sweep deleted count through what it kept of them
        (`kept_runs`, `KEPT_RUNS` per family: a `limit` above it sees fewer of them)."""
        done = JobState.COMPLETED.value
        runs = ("SELECT run_s, end_time, id FROM jobs WHERE uid=? AND end_time IS NOT NULL AND state=? {also} "
                "UNION ALL SELECT run_s, end_time, job_id FROM kept_runs WHERE uid=? {also} "
                "ORDER BY end_time DESC, id DESC LIMIT ?")
        with self._lock:
            same = self._db.execute(runs.format(also="AND name=?"), (uid, done, name, uid, name, limit)).fetchall()
            any_ = self._db.execute(runs.format(also=""), (uid, done, uid, limit)).fetchall()
        return [r[0] for r in reversed(same)], [r[0] for r in reversed(any_)]

    def get(self, job_id: int) -> Optional[JobRecord]:
        with self._lock:
            row = self._db.execute(f"SELECT {RECORD_COLUMNS} FROM {RECORD_FROM} WHERE j.id=?",
                                   (job_id,)).fetchone()
        return JobRecord.from_row(row) if row else None

    def env(self, job_id: int) -> dict[str, str]:
        """The environment the job was submitted with (needed only to launch it; {} once it ended)."""
        with self._lock:
            row = self._db.execute("SELECT env FROM job_specs WHERE job_id=?", (job_id,)).fetchone()
        return json.loads(row[0]) if row and row[0] is not None else {}

    def list(self, user: Optional[str] = None, live_only: bool = False,
             states: Optional[Iterable[JobState]] = None) -> list[JobRecord]:
        sql, args = f"SELECT {RECORD_COLUMNS} FROM {RECORD_FROM}", []
        where = []
        if user is not None:
            where.append("j.user=?")
            args.append(user)
        if live_only:
            where.append(f"j.state NOT IN {_TERMINAL_SQL}")
        if states is not None:
            wanted = [s.value for s in states]
            where.append(f"j.state IN ({','.join('?' * len(wanted))})")
            args.extend(wanted)
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY j.id"
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    def update(self, job_id: int, now: float, event: NewEvent | str | None = None, initiator: Optional[str] = None,
               **changes: Any) -> None:
        """Change columns of a job; with `event`, also record an event, atomically.

        The event's state is the job's state after the change. A change of state, or an event of a
        kind that moves jobs, must be an edge of gpuswap.lifecycle's table, and the record it leaves
        must carry what its state does (lifecycle.CARRIES): otherwise IllegalTransition (or its
        InvalidRecord) is raised and nothing is written; a user's request the job's state no
        longer admits (it ended since the caller read it) raises RequestTooLate. A bare sentence is
        an event of no kind (it can change no state); `initiator` ('policy' or 'user') says who
        asked, when `event` does not.
        """
        if not changes and event is None:
            return
        ev = NewEvent(None, event) if isinstance(event, str) else event
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                kind = ev.kind if ev is not None else None
                checked = kind is not None and (kind not in lifecycle.NOTES or kind in lifecycle.REQUESTS)
                if "state" in changes or checked:
                    row = self._db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
                    if row is not None:
                        new = changes.get("state")
                        lifecycle.check_request(JobState(row[0]), kind)
                        lifecycle.check(JobState(row[0]), kind, JobState(new) if new is not None else None)
                carried = not lifecycle.CARRIED_FIELDS.isdisjoint(changes)
                before = self._record(job_id) if carried else None
                if "state" in changes:
                    changes.setdefault("state_since", now)
                changes["version"] = self._next_version()
                if changes:
                    cols = ", ".join(f"{k}=?" for k in changes)
                    self._db.execute(
                        f"UPDATE jobs SET {cols} WHERE id=?",
                        [encode(k, v) for k, v in changes.items()] + [job_id],
                    )
                if before is not None:     # what the state carries (lifecycle.CARRIES), as written
                    lifecycle.check_record(self._record(job_id), lifecycle.violations(before))
                if changes.get("state") in _ENDED:   # its environment is never needed again
                    self._db.execute("UPDATE job_specs SET env=NULL WHERE job_id=?", (job_id,))
                if ev is not None:
                    state = self._db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()[0]
                    self._db.execute(_EVENT_INSERT, (job_id, now, state, ev.text, ev.initiator or initiator,
                                                     *ev.facts()))
                    if "reason" not in changes:
                        self._db.execute("UPDATE jobs SET reason=? WHERE id=?", (ev.text, job_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise

    def add_event(self, job_id: int, now: float, state: JobState, text: str,
                  kind: EventKind = EventKind.WAITING) -> None:
        """Record an event that changes nothing about the job (why it waits): its row, its `reason`
        (the last transition's) and its version stay as they are."""
        if kind not in lifecycle.NOTES:
            raise IllegalTransition(f"an event {kind.value!r} is not a note; record it with update()")
        with self._lock:
            self._db.execute(_EVENT_INSERT, (job_id, now, state.value, text, None, kind.value, None, None))

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
                f"SELECT {RECORD_COLUMNS} FROM {RECORD_FROM} WHERE j.version > ? ORDER BY j.version", (version,)
            ).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    # -- bounded listings and retention (issue 10: many finished jobs must cost nothing) ----
    def page(self, uid: Optional[int], limit: int, before: Optional[int] = None,
             after: Optional[int] = None, max_bytes: int = 1 << 62) -> tuple[list[JobRecord], bool]:
        """At most `limit` jobs (of `uid`: by the kernel's identity, never a name a new account
        could take over) in id order, and no more argv bytes than `max_bytes` (at least one
        job): after `after` (the oldest first), else the newest below `before` (or the newest of
        all). Returns (jobs, more): whether jobs remain beyond the page in that direction."""
        where, args = ["1"], []
        if uid is not None:
            where.append("j.uid=?")
            args.append(uid)
        if after is not None:
            where.append("j.id>?")
            args.append(after)
        elif before is not None:
            where.append("j.id<?")
            args.append(before)
        order = "ASC" if after is not None else "DESC"
        with self._lock:
            sizes = self._db.execute(
                f"SELECT j.id, COALESCE(s.argv_bytes, 0) FROM {RECORD_FROM} WHERE {' AND '.join(where)} "
                f"ORDER BY j.id {order} LIMIT ?", [*args, limit + 1]).fetchall()
            ids, total = [], 0
            for jid, size in sizes[:limit]:
                if ids and total + size > max_bytes:
                    break
                ids.append(jid)
                total += size
            more = len(ids) < len(sizes)
            return self._records(ids), more

    def _records(self, ids: list[int], argv: bool = True) -> list[JobRecord]:
        """The jobs with these ids, in id order (without argv: `argv` = [], job_specs unread).
        Listings pick ids from `jobs` alone first, so a filter or sort never reads the argv of
        rows it then drops."""
        if not ids:
            return []
        columns, source = (RECORD_COLUMNS, RECORD_FROM) if argv else (RECORD_COLUMNS_NO_ARGV, "jobs j")
        with self._lock:
            rows = self._db.execute(
                f"SELECT {columns} FROM {source} WHERE j.id IN ({','.join('?' * len(ids))}) "
                "ORDER BY j.id", ids).fetchall()
        return [JobRecord.from_row(r) for r in rows]

    def count(self, uid: Optional[int] = None) -> int:
        with self._lock:
            if uid is None:
                return int(self._db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
            return int(self._db.execute("SELECT COUNT(*) FROM jobs WHERE uid=?", (uid,)).fetchone()[0])

    def recent_finished(self, uid: Optional[int], n: int) -> list[JobRecord]:
        """The `n` newest finished jobs (of `uid`), oldest first, without their argv (summaries):
        read through the id index, so thousands of finished jobs cost no more than twenty."""
        sql = f"SELECT id FROM jobs WHERE state IN {_TERMINAL_SQL}"
        args: list[Any] = []
        if uid is not None:
            sql += " AND uid=?"
            args.append(uid)
        with self._lock:
            ids = [r[0] for r in self._db.execute(sql + " ORDER BY id DESC LIMIT ?", [*args, n]).fetchall()]
        return self._records(ids, argv=False)

    @contextmanager
    def at_one_instant(self) -> Iterator[None]:
        """Hold it to make several reads see one instant: every write holds the same lock, so a job
        that ends between two reads (the live list, then the finished one; a record, then its events)
        cannot show in both, in neither, or contradict itself (the dashboard drew such a job twice).
        Hold it only for reads."""
        with self._lock:
            yield

    def expired(self, ended_before: float, limit: int) -> list[int]:
        """Ids of finished jobs that ended before `ended_before`, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM jobs WHERE state IN {_TERMINAL_SQL} AND COALESCE(end_time, state_since) < ? "
                "ORDER BY id LIMIT ?", (ended_before, limit)).fetchall()
        return [int(r[0]) for r in rows]

    def delete_finished(self, job_id: int) -> bool:
        """Forget a finished job: its row, spec, events and decisions, in one transaction. A job
        that is not finished is never touched (returns False)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._keep_run(job_id)
                gone = self._db.execute(f"DELETE FROM jobs WHERE id=? AND state IN {_TERMINAL_SQL}",
                                        (job_id,)).rowcount > 0
                if gone:
                    for table in ("job_specs", "events", "decisions"):
                        self._db.execute(f"DELETE FROM {table} WHERE job_id=?", (job_id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return gone

    def _keep_run(self, job_id: int) -> None:
        """In the open transaction: what the predictor needs of a completed job about to be deleted,
        and its family trimmed to its newest `KEPT_RUNS` (a failed or cancelled run predicts nothing,
        as `finished_runs` reads)."""
        row = self._db.execute("SELECT uid, name FROM jobs WHERE id=? AND state=? AND end_time IS NOT NULL",
                               (job_id, JobState.COMPLETED.value)).fetchone()
        if row is None:
            return
        self._db.execute("INSERT OR REPLACE INTO kept_runs (job_id,user,uid,name,run_s,end_time) "
                         "SELECT id,user,uid,name,run_s,end_time FROM jobs WHERE id=?", (job_id,))
        self._db.execute("DELETE FROM kept_runs WHERE uid=? AND name=? AND job_id NOT IN (SELECT job_id FROM "
                         "kept_runs WHERE uid=? AND name=? ORDER BY end_time DESC, job_id DESC LIMIT ?)",
                         (*row, *row, KEPT_RUNS))

    def events(self, job_id: int) -> list[Event]:
        with self._lock:
            rows = self._db.execute(
                "SELECT time,state,reason,kind,tier,mechanism,initiator FROM events WHERE job_id=? ORDER BY id",
                (job_id,)).fetchall()
        return [Event(*r) for r in rows]

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

    # -- class-budget usage (policy/classes.py): (user, class) -> decayed GPU-seconds ----------
    def load_class_usage(self) -> dict[tuple[str, int], float]:
        with self._lock:
            return {(r["user"], int(r["priority"])): r["gpu_s"]
                    for r in self._db.execute("SELECT user,priority,gpu_s FROM class_usage")}

    def save_class_usage(self, usage: dict[tuple[str, int], float], now: float) -> None:
        """Replace the table with `usage`: a (user, class) decayed to nothing is dropped by
        `decay_usage` and must not come back at the next start."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM class_usage")
            self._db.executemany("INSERT INTO class_usage (user,priority,gpu_s,updated) VALUES (?,?,?,?)",
                                 [(u, p, v, now) for (u, p), v in usage.items()])
            self._db.execute("COMMIT")

    # -- switch-cost bandwidths learned from real moves (node/bandwidth.py) ----------------
    def load_bandwidths(self, node: str = "") -> dict[str, tuple[float, int]]:
        """field -> (bytes/s, real moves folded in), as last saved for `node` (a pool's node by its
        name; '': the daemon's own machine)."""
        with self._lock:
            rows = self._db.execute("SELECT field,bytes_per_s,samples FROM bandwidths WHERE node=?",
                                    (node,)).fetchall()
        return {r["field"]: (float(r["bytes_per_s"]), int(r["samples"])) for r in rows}

    def save_bandwidth(self, field: str, bytes_per_s: float, samples: int, now: float, node: str = "") -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO bandwidths (node,field,bytes_per_s,samples,updated) VALUES (?,?,?,?,?) "
                "ON CONFLICT(node,field) DO UPDATE SET bytes_per_s=excluded.bytes_per_s, "
                "samples=excluded.samples, updated=excluded.updated",
                (node, field, bytes_per_s, samples, now))

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

    def last_event_id(self) -> int:
        """The newest event's id (0: none): with `at_one_instant`, where the events stood when
        other reads were made."""
        with self._lock:
            return int(self._db.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0])

    def events_after(self, after_id: int, limit: int = 10000) -> list[EventRow]:
        """Events past `after_id`, oldest first: the table only grows."""
        with self._lock:
            rows = self._db.execute("SELECT id,job_id,time,state,reason,initiator,kind,tier,mechanism FROM events "
                                    "WHERE id>? ORDER BY id LIMIT ?", (after_id, limit)).fetchall()
        return [EventRow(*r) for r in rows]
