"""The layout of `state.db` as ordered migration steps, numbered by SQLite's `PRAGMA user_version`.

A column the code starts to use must reach every database already written, and a database written
by a newer gpuswap must never be read by an older one (it would miss what it cannot see, or drop
it). So the layout is a list of steps: step N takes a database at version N-1 to version N. Steps
are only ever appended, never edited: databases in the field ran each step as it was when they did.

All pending steps run in one IMMEDIATE transaction when the store opens, with `user_version` set at
its end, so a crash leaves the old layout or the new one, never a mix. Two processes opening an old
database at once (the daemon and a helper, two helpers) do not both migrate: the second waits for
the write lock, reads the version again under it and finds nothing left to do. A database whose
version is newer than the last step here is refused before anything is written to it.
"""
from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger("gpuswap.store")


class SchemaTooNew(Exception):
    """The database was written by a newer gpuswap: reading it could misread or lose its data."""

    def __init__(self, path: Path, found: int, known: int):
        self.path, self.found, self.known = path, found, known
        super().__init__(f"{path} was written by a newer gpuswap (database schema version {found}; this one "
                         f"knows up to {known}): run that version or newer, nothing was changed")


@dataclass(frozen=True)
class Step:
    version: int                                 # the database's user_version once it has run
    what: str
    apply: Callable[[sqlite3.Connection], None]  # runs inside the migration's transaction


# -- version 1: the layout of gpuswap 0.1.0, from any database written before versions existed ----
# Frozen: these statements are what every version-1 database ran. Never edit them; append a step.
BASELINE_DDL = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    cwd TEXT NOT NULL,
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
    residue TEXT NOT NULL DEFAULT '{}',
    ranks TEXT NOT NULL DEFAULT '[]',
    version INTEGER NOT NULL DEFAULT 0,
    width INTEGER NOT NULL DEFAULT 1,
    ram_refusal TEXT
);
CREATE INDEX IF NOT EXISTS jobs_version ON jobs(version);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE INDEX IF NOT EXISTS jobs_user ON jobs(user);
-- A job's bulky, rarely read data, out of the hot `jobs` rows (which the controller and every
-- listing scan): its argv (read for records) and its environment (read only to launch it;
-- dropped once the job ends). Deleted with the job by the retention sweep (node/retention.py).
-- (argv_bytes first: reading it must not walk the overflow pages of the bulky columns after it)
CREATE TABLE IF NOT EXISTS job_specs (
    job_id INTEGER PRIMARY KEY,
    argv_bytes INTEGER NOT NULL,
    argv TEXT NOT NULL,
    env TEXT
);
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
CREATE INDEX IF NOT EXISTS decisions_job ON decisions(job_id);
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
# Columns `jobs` gained while databases had no version: one written before them gains them here
# (ADD COLUMN fills the default into every row).
_BASELINE_ADDED_JOB_COLUMNS = (("residue", "TEXT NOT NULL DEFAULT '{}'"), ("ranks", "TEXT NOT NULL DEFAULT '[]'"),
                               ("width", "INTEGER NOT NULL DEFAULT 1"), ("ram_refusal", "TEXT"))
_BASELINE_ENDED = "('COMPLETED','FAILED','CANCELLED')"


def columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _baseline(db: sqlite3.Connection) -> None:
    """Create the 0.1.0 layout, or bring any database written before versions existed up to it:
    every table and index made if absent; argv and env, once columns of `jobs`, moved to job_specs
    (a finished job's environment dropped, as it is when a job ends now); columns added since."""
    for statement in BASELINE_DDL.split(";"):   # the DDL holds no other ';'
        if statement.strip():
            db.execute(statement)
    if "env" in columns(db, "jobs"):
        db.execute("INSERT OR REPLACE INTO job_specs (job_id, argv, argv_bytes, env) "
                   "SELECT id, argv, length(CAST(argv AS BLOB)), "
                   f"CASE WHEN state IN {_BASELINE_ENDED} THEN NULL ELSE env END FROM jobs")
        db.execute("ALTER TABLE jobs DROP COLUMN argv")
        db.execute("ALTER TABLE jobs DROP COLUMN env")
    have = columns(db, "jobs")
    for name, definition in _BASELINE_ADDED_JOB_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {definition}")
    if "initiator" not in columns(db, "events"):
        db.execute("ALTER TABLE events ADD COLUMN initiator TEXT")


# -- version 2: events say what they record (issue 14): its kind, tier and mechanism -------------
# Rows written before carry only a sentence. Their kind, tier, mechanism and initiator are inferred
# here, once, from the wording gpuswap used then (the only place that reads an event's text), so the
# metrics fold old and new rows alike; a sentence no rule matches keeps kind NULL.
_EVENT_KINDS = (
    # (kind, SQL condition on the row, tier, mechanism)
    ("submitted", "state='PENDING' AND reason='submitted'", None, None),
    ("started", "state='RUNNING' AND reason GLOB 'started on GPU*'", None, None),
    ("park_started", "state='PAUSING' AND reason GLOB 'freezing through the driver*'", "ram", "transparent"),
    ("park_started", "state='PAUSING' AND reason GLOB 'pausing to ram*'", "ram", "cooperative"),
    ("park_started", "state='PAUSING' AND reason GLOB 'pausing to disk*'", "disk", "cooperative"),
    ("parked_ram", "state='PAUSED' AND reason GLOB 'parked in RAM*'", "ram", "cooperative"),
    ("frozen", "state='PAUSED' AND reason GLOB 'frozen transparently*'", "ram", "transparent"),
    ("sigstopped", "state='PAUSED' AND reason GLOB '*SIGSTOP*'", "gpu", "sigstop"),
    ("spill_requested", "state='PAUSED' AND reason GLOB 'spill to disk requested*'", "disk", "cooperative"),
    ("spill_requested", "state='PAUSED' AND reason GLOB 'spilling from RAM to disk*'", "disk", "cooperative"),
    ("spill_failed", "state='PAUSED' AND reason GLOB 'spill to disk failed*'", "disk", "cooperative"),
    ("resume_started", "state='RESUMING' AND reason GLOB 'resuming from RAM*'", "ram", "cooperative"),
    ("resume_started", "state='RESUMING' AND reason GLOB 'thawing*'", "ram", "transparent"),
    ("resume_started", "state='RESUMING' AND reason GLOB 'restarting from its disk checkpoint*'", "disk",
     "cooperative"),
    ("resumed_ram", "state='RUNNING' AND reason GLOB 'resumed from RAM*'", "ram", "cooperative"),
    ("thawed", "state='RUNNING' AND reason GLOB 'thawed*'", "ram", "transparent"),
    ("continued", "state='RUNNING' AND reason GLOB 'continued (SIGCONT)*'", "gpu", "sigstop"),
    ("park_failed", "state='RUNNING' AND reason GLOB 'park failed*'", None, None),
    ("cannot_park", "state='RUNNING' AND reason GLOB 'cannot park*'", None, None),
    ("cannot_freeze", "state='RUNNING' AND reason GLOB 'cannot freeze transparently*'", None, "transparent"),
    ("completed", "state='COMPLETED'", None, None),
    ("failed", "state='FAILED'", None, None),
    ("cancelled", "state='CANCELLED'", None, None),
    ("waiting", "reason GLOB 'waiting (*'", None, None),
)


def _event_kinds(db: sqlite3.Connection) -> None:
    have = columns(db, "events")
    for name in ("kind", "tier", "mechanism"):
        if name not in have:
            db.execute(f"ALTER TABLE events ADD COLUMN {name} TEXT")
    for kind, where, tier, mechanism in _EVENT_KINDS:
        db.execute(f"UPDATE events SET kind=?, tier=?, mechanism=? WHERE kind IS NULL AND {where}",
                   (kind, tier, mechanism))
    # A park to disk: a spill when the job was already PAUSED (parked in RAM) before it.
    db.execute("UPDATE events SET tier='disk', mechanism='cooperative', kind=CASE WHEN (SELECT p.state FROM "
               "events p WHERE p.job_id=events.job_id AND p.id<events.id ORDER BY p.id DESC LIMIT 1)='PAUSED' "
               "THEN 'spilled' ELSE 'parked_disk' END WHERE kind IS NULL AND state='PAUSED' "
               "AND reason GLOB 'parked to disk*'")
    # Who asked, for rows from before `initiator`: a user's pause or spill said so in its sentence.
    db.execute("UPDATE events SET initiator=CASE WHEN reason GLOB '*requested by user*' "
               "OR reason GLOB 'spill to disk requested*' THEN 'user' ELSE 'policy' END "
               "WHERE initiator IS NULL AND (kind IN ('park_started','spill_requested') "
               "OR (kind IS NULL AND state='PAUSING'))")


# -- version 3: the API records a user's pause as intent only (issue 14): the tier the user asked for --
# Until now the API wrote the requested tier into `desired_tier`, the controller's own column (what
# the job's supervisor is asked). A held job's request moves to `hold_tier`; for a live held job
# written before, the tier its request named was `desired_tier` (the API's write, or the controller's
# once it acted on it), so a request made just before the upgrade is still carried out after it.
def _hold_tier(db: sqlite3.Connection) -> None:
    if "hold_tier" not in columns(db, "jobs"):
        db.execute("ALTER TABLE jobs ADD COLUMN hold_tier TEXT")
    db.execute(f"UPDATE jobs SET hold_tier=desired_tier WHERE hold=1 AND state NOT IN {_BASELINE_ENDED} "
               "AND desired_tier IN ('ram','disk')")


# -- version 4: each user's decayed GPU-time per class, for the class budgets (issue 15 item 5) --
def _class_usage(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS class_usage (user TEXT NOT NULL, priority INTEGER NOT NULL, "
               "gpu_s REAL NOT NULL, updated REAL NOT NULL, PRIMARY KEY (user, priority))")


# -- version 5: runtime estimates (issue 15 items 3 and 8) -----------------------------------------
# A job's
# `--time` and the estimate made for it at submission (policy/estimate.py) with where it came from.
# Older rows have none: their jobs are ranked by attained service, as they were. What the predictor
# learns from needs no table: the finished jobs' rows (user, name, run_s, end_time) are it.
_ESTIMATE_COLUMNS = (("time_limit_s", "REAL"), ("estimate_s", "REAL"), ("estimate_from", "TEXT"),
                     ("estimate_runs", "INTEGER NOT NULL DEFAULT 0"))


def _estimates(db: sqlite3.Connection) -> None:
    have = columns(db, "jobs")
    for name, definition in _ESTIMATE_COLUMNS:
        if name not in have:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {definition}")
    # The predictor's query: a user's finished runs, newest first (COMPLETED, by end time).
    db.execute("CREATE INDEX IF NOT EXISTS jobs_user_end ON jobs(user, end_time)")


def _node(db: sqlite3.Connection) -> None:
    if "node" not in columns(db, "jobs"):
        db.execute("ALTER TABLE jobs ADD COLUMN node TEXT")


# -- version 7: a pool's switch-cost figures per node (docs/ray.md) -------------------------------
# Each node's disks and links are its own, so what real moves taught is kept per (node, field).
# The key changes, which ALTER TABLE cannot do: a new table filled from the old one. The rows a
# single daemon learned are its own machine's, node '' (a single daemon's jobs carry no node).
def _bandwidths_by_node(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE bandwidths_by_node (node TEXT NOT NULL DEFAULT '', field TEXT NOT NULL, "
               "bytes_per_s REAL NOT NULL, samples INTEGER NOT NULL, updated REAL NOT NULL, "
               "PRIMARY KEY (node, field))")
    db.execute("INSERT INTO bandwidths_by_node (node,field,bytes_per_s,samples,updated) "
               "SELECT '',field,bytes_per_s,samples,updated FROM bandwidths")
    db.execute("DROP TABLE bandwidths")
    db.execute("ALTER TABLE bandwidths_by_node RENAME TO bandwidths")


# -- version 8: the predictor's history outlives the retention sweep (issue 15 item 8) ------------
# A family that runs once a month would lose every earlier run to a 30-day retention, and with
# them its estimate. The sweep moves a completed job's (user, name, run_s, end_time) here as it
# deletes the row, keeping each family's newest few (store.py, KEPT_RUNS); nothing else of the
# job is kept.
def _kept_runs(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS kept_runs (job_id INTEGER PRIMARY KEY, user TEXT NOT NULL, "
               "name TEXT NOT NULL, run_s REAL NOT NULL, end_time REAL NOT NULL)")
    db.execute("CREATE INDEX IF NOT EXISTS kept_runs_family ON kept_runs(user, name, end_time)")
    db.execute("CREATE INDEX IF NOT EXISTS kept_runs_user ON kept_runs(user, end_time)")


# -- version 9: listings filter by uid (the identity the kernel gives, not a name) --------------
# A user deleted and made again under the same name (another uid) listed the first one's jobs,
# argv and all, while `show` (by uid) refused them: every listing now goes by uid.
def _uid_index(db: sqlite3.Connection) -> None:
    db.execute("CREATE INDEX IF NOT EXISTS jobs_uid ON jobs(uid, id)")


# -- version 10: the runtime predictor learns from a uid's runs, not a name's --------------------
# An account made again under a deleted one's name (another uid) got estimates from the first
# one's runs, and `show` told it how many there were and how long they took: what listings refuse
# it since version 9. The sweep's kept runs gain their uid. An old kept run takes the uid of the
# jobs still recorded under its name when they all have one uid; otherwise (its name's jobs all
# swept, or several uids) it is dropped: it would predict for nobody. (An account deleted with all
# its jobs swept, then made again under its name before this step, still takes its kept runs: no
# record says it is another.) The indexes by name go; those by uid serve the predictor now.
def _kept_runs_uid(db: sqlite3.Connection) -> None:
    if "uid" not in columns(db, "kept_runs"):
        db.execute("ALTER TABLE kept_runs ADD COLUMN uid INTEGER")
    db.execute("UPDATE kept_runs SET uid = (SELECT MIN(j.uid) FROM jobs j WHERE j.user = kept_runs.user) "
               "WHERE uid IS NULL AND (SELECT COUNT(DISTINCT j.uid) FROM jobs j WHERE j.user = kept_runs.user) = 1")
    db.execute("DELETE FROM kept_runs WHERE uid IS NULL")
    for old in ("kept_runs_family", "kept_runs_user", "jobs_user_end"):
        db.execute(f"DROP INDEX IF EXISTS {old}")
    db.execute("CREATE INDEX IF NOT EXISTS kept_runs_uid_family ON kept_runs(uid, name, end_time)")
    db.execute("CREATE INDEX IF NOT EXISTS kept_runs_uid_end ON kept_runs(uid, end_time)")
    db.execute("CREATE INDEX IF NOT EXISTS jobs_uid_end ON jobs(uid, end_time)")


# Append only: step N at index N-1. A new column is a new step (an `ALTER TABLE ... ADD COLUMN`
# with a default every existing row can take), and the code that reads it comes with it.
STEPS: tuple[Step, ...] = (
    Step(1, "the gpuswap 0.1.0 layout (and any earlier database brought up to it)", _baseline),
    Step(2, "events gain kind, tier and mechanism (old rows' inferred from their wording)", _event_kinds),
    Step(3, "jobs gain hold_tier, the tier a user's pause asked for (held live jobs' from desired_tier)",
         _hold_tier),
    Step(4, "class_usage: each user's decayed GPU-time in the urgent and high classes", _class_usage),
    Step(5, "jobs gain time_limit_s and their runtime estimate (estimate_s, estimate_from, estimate_runs)",
         _estimates),
    Step(6, "jobs gain node, the pool node a job runs or is parked on (NULL: the daemon's own machine)", _node),
    Step(7, "bandwidths are kept per pool node (key node, field; '': the daemon's own machine)",
         _bandwidths_by_node),
    Step(8, "kept_runs: completed jobs' run times, kept for the runtime predictor past the retention sweep",
         _kept_runs),
    Step(9, "an index on jobs(uid, id): listings filter by uid", _uid_index),
    Step(10, "kept_runs gain uid: the runtime predictor learns from a uid's runs (old ones: their name's one uid, "
             "else dropped)",
         _kept_runs_uid),
)
LATEST = STEPS[-1].version


def user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def refuse_newer(db: sqlite3.Connection, path: Path, steps: Sequence[Step] = STEPS) -> int:
    """The database's version; SchemaTooNew if it is past the last step known here. Only reads:
    call it before anything (even `journal_mode`) writes to the file."""
    found, known = user_version(db), steps[-1].version
    if found > known:
        raise SchemaTooNew(path, found, known)
    return found


def migrate(db: sqlite3.Connection, path: Path, steps: Sequence[Step] = STEPS) -> list[int]:
    """Run the steps the database has not run, in one IMMEDIATE transaction; returns their
    versions ([] when it was up to date). `db` must be in autocommit mode (isolation_level=None)."""
    if refuse_newer(db, path, steps) == steps[-1].version:
        return []
    db.execute("BEGIN IMMEDIATE")
    try:
        found = refuse_newer(db, path, steps)   # again, under the write lock: another opener may have migrated
        pending = [s for s in steps if s.version > found]
        for step in pending:
            step.apply(db)
        if pending:
            db.execute(f"PRAGMA user_version={int(steps[-1].version)}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:    # SQLite may have rolled back itself (a full disk)
            db.execute("ROLLBACK")
        raise
    if pending:
        log.info("%s: database schema upgraded from version %d to %d", path, found, steps[-1].version)
    return [s.version for s in pending]
