"""state.db's schema versions (node/schema.py): databases saved by earlier releases are migrated
and read back the same, a newer one is refused untouched, concurrent openers migrate once, and a
step appended later runs. The saved databases are in tests/data/statedb (README.md there)."""
from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpuswap.node import schema
from gpuswap.node.schema import LATEST, STEPS, SchemaTooNew, Step
from gpuswap.node.store import NewJob, Store

DATA = Path(__file__).resolve().parents[1] / "data" / "statedb"
RELEASE = "release-1ae36f0"      # main when versions came: the last layout without one
FIRST = "first-e424481"          # the first layout (argv and env in `jobs`, no initiator, ...)
_spec = importlib.util.spec_from_file_location("make_state_db", DATA / "make_state_db.py")
make_state_db = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_state_db)


def saved(name: str, path: Path) -> Path:
    """The database a release saved, as a file again."""
    db = sqlite3.connect(path)
    db.executescript((DATA / f"{name}.sql").read_text())
    db.close()
    return path


def expected(name: str) -> dict:
    """What that release read from it; for the first layout, as migrated: the columns added since
    read as their defaults, and a finished job's environment is dropped (as when a job ends now)."""
    want = json.loads((DATA / f"{name}.json").read_text())
    for job in want["jobs"]:
        for column, default in (("residue", {}), ("ranks", []), ("width", 1), ("ram_refusal", None),
                                ("hold_tier", None),
                                # version 5: no --time and no estimate for jobs submitted before it
                                ("time_limit_s", None), ("estimate_s", None), ("estimate_from", None),
                                ("estimate_runs", 0),
                                # version 6: no pool node (docs/ray.md) for jobs of a single daemon
                                ("node", None)):
            job.setdefault(column, default)
        if job["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
            want["env"][str(job["id"])] = {}
    want["events_after"] = [e if len(e) == 6 else e + [None] for e in want["events_after"]]   # + initiator
    # Version 2 (events say what they record): each saved sentence's kind, tier and mechanism as the
    # migration infers them from the release's wording, and who asked a pause the release did not record.
    inferred = {"submitted": ("submitted", None, None), "started on GPU": ("started", None, None),
                "pausing to ram:": ("park_started", "ram", "cooperative"),
                "pausing to disk:": ("park_started", "disk", "cooperative"),
                "parked in RAM": ("parked_ram", "ram", "cooperative"),
                "no gpuswap runtime: stopped (SIGSTOP)": ("sigstopped", "gpu", "sigstop"),
                "exited with code 0": ("completed", None, None), "killed by signal 9": ("failed", None, None),
                "cancelled by alice": ("cancelled", None, None)}

    def facts(reason: str, initiator: str | None) -> list:
        kind, tier, mechanism = next((v for k, v in inferred.items() if reason.startswith(k)), (None, None, None))
        if kind == "park_started" and initiator is None:
            initiator = "user" if "requested by user" in reason else "policy"
        return [initiator, kind, tier, mechanism]

    want["events_after"] = [e[:5] + facts(e[4], e[5]) for e in want["events_after"]]
    for job, job_events in want["events"].items():      # a job's events, in id order
        rows = [e for e in want["events_after"] if str(e[1]) == job]
        assert [(e["time"], e["reason"]) for e in job_events] == [(r[2], r[4]) for r in rows]
        for event, row in zip(job_events, rows):
            event.update(initiator=row[5], kind=row[6], tier=row[7], mechanism=row[8])
    return want


def layout(path: Path) -> dict:
    """Tables (columns by name: ADD COLUMN appends, so their order differs between a fresh and an
    upgraded database, and nothing reads by position) and indexes, from sqlite_master."""
    db = sqlite3.connect(path)
    try:
        out = {}
        for kind, name, table in db.execute("SELECT type, name, tbl_name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"):
            if kind == "table":
                out[name] = sorted(tuple(r)[1:] for r in db.execute(f"PRAGMA table_info({name})"))
            else:
                out[name] = (kind, table, [r[2] for r in db.execute(f"PRAGMA index_info({name})")])
        return out
    finally:
        db.close()


def version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return schema.user_version(db)
    finally:
        db.close()


def fresh(path: Path) -> Path:
    Store(path).close()
    return path


@pytest.mark.parametrize("name", [RELEASE, FIRST])
def test_a_database_saved_by_a_release_is_migrated_and_reads_back_the_same(tmp_path, name):
    path = saved(name, tmp_path / "state.db")
    assert version(path) == 0
    assert make_state_db.read_back(path) == expected(name)     # read_back opens it with this Store
    assert version(path) == LATEST
    assert layout(path) == layout(fresh(tmp_path / "fresh.db"))
    db = sqlite3.connect(path)
    assert not {"argv", "env"} & schema.columns(db, "jobs")
    db.close()
    store = Store(path)                      # it goes on where the release left off
    try:
        top = max(j.version for j in store.list())
        [job] = store.add_jobs([NewJob(name="after", user="u", uid=1, gid=1, argv=["true"], cwd="/", env={"A": "1"},
                                       priority=1, gpus=1, mem_bytes=0)], 1.0)
        assert job == 12                     # after the release's last id, even one it deleted
        assert [j.id for j in store.changed_since(top)] == [job] and store.env(job) == {"A": "1"}
    finally:
        store.close()


def test_opening_an_up_to_date_database_changes_nothing(tmp_path, caplog):
    path = fresh(tmp_path / "state.db")
    before = layout(path)
    with caplog.at_level("INFO", logger="gpuswap.store"):
        Store(path).close()
    assert version(path) == LATEST and layout(path) == before
    assert "upgraded" not in caplog.text


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_a_database_from_a_newer_version_is_refused_untouched(tmp_path, journal):
    """A downgrade must not read what it cannot see: the store and the daemon refuse it in one
    line, before anything (not even the journal mode) is written to the file."""
    home = tmp_path / "home"
    home.mkdir()
    path = fresh(home / "state.db")
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA journal_mode={journal}")
    db.execute(f"PRAGMA user_version={LATEST + 1}")
    db.commit()
    db.close()
    assert sorted(p.name for p in home.iterdir()) == ["state.db"]
    data, mtime = path.read_bytes(), path.stat().st_mtime_ns
    with pytest.raises(SchemaTooNew) as refused:
        Store(path)
    assert f"database schema version {LATEST + 1}; this one knows up to {LATEST}" in str(refused.value)
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1x1GiB"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, GPUSWAP_HOME=str(home)))
    assert r.returncode == 1, r
    assert r.stderr == f"gpuswap server: {path} was written by a newer gpuswap (database schema version " \
                       f"{LATEST + 1}; this one knows up to {LATEST}): run that version or newer, nothing was changed\n"
    assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime
    assert not (home / "state.db-wal").exists() or (home / "state.db-wal").stat().st_size == 0


def test_a_held_jobs_requested_tier_moves_to_hold_tier(tmp_path):
    """Version 3: the API wrote a user's pause tier into `desired_tier` (the controller's column); it is
    `hold_tier` now. A held live job keeps what its request named, so a pause or spill asked just
    before the upgrade is still carried out after it; other rows gain no tier."""
    path = tmp_path / "state.db"
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, STEPS[:2]) == [1, 2]       # a database version 2 wrote
    ids = {}
    for name, state, parked, hold, tier in (("running", "RUNNING", None, 1, "disk"), ("spilling", "PAUSED", "ram", 1, "disk"),
                                            ("in-ram", "PAUSED", "ram", 1, "ram"), ("ended", "COMPLETED", None, 1, "disk"),
                                            ("unheld", "PAUSING", None, 0, "ram")):
        ids[name] = db.execute(
            "INSERT INTO jobs (name,user,uid,gid,cwd,priority,gpus,mem_bytes,preemptible,state,submit_time,state_since,"
            "parked,hold,desired_tier) VALUES (?,'u',1,1,'/',1,1,0,1,?,1,1,?,?,?)",
            (name, state, parked, hold, tier)).lastrowid
    db.close()
    store = Store(path)
    try:
        assert {n: store.get(i).hold_tier for n, i in ids.items()} == {
            "running": "disk", "spilling": "disk", "in-ram": "ram", "ended": None, "unheld": None}
    finally:
        store.close()
    assert version(path) == LATEST


def _probe(column: str, ran: list[int] | None = None) -> Step:
    """A step as a later version would append it: one more `jobs` column."""
    def apply(db: sqlite3.Connection) -> None:
        db.execute(f"ALTER TABLE jobs ADD COLUMN {column} INTEGER NOT NULL DEFAULT 7")  # fails if run twice
        if ran is not None:
            ran.append(LATEST + 1)
    return Step(LATEST + 1, f"add jobs.{column}", apply)


def test_steps_are_numbered_in_order_and_an_appended_step_runs(tmp_path):
    assert [s.version for s in STEPS] == list(range(1, len(STEPS) + 1)) and LATEST == len(STEPS)
    ran: list[int] = []
    later = (*STEPS, _probe("later", ran))
    path = saved(RELEASE, tmp_path / "state.db")
    Store(path).close()                           # this version's steps
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, later) == [LATEST + 1] and ran == [LATEST + 1]
    assert schema.migrate(db, path, later) == [] and ran == [LATEST + 1]
    assert {r[0] for r in db.execute("SELECT later FROM jobs")} == {7}
    db.close()
    assert version(path) == LATEST + 1
    with pytest.raises(SchemaTooNew):            # and this version now refuses it
        Store(path)
    empty = tmp_path / "empty.db"                 # all steps, from nothing, in one go
    db = sqlite3.connect(empty, isolation_level=None)
    assert schema.migrate(db, empty, later) == list(range(1, LATEST + 2))
    db.close()
    assert layout(empty) == layout(path)


def test_a_failing_step_leaves_the_database_as_it_was(tmp_path):
    path = saved(FIRST, tmp_path / "state.db")
    before = layout(path)

    def broken(db: sqlite3.Connection) -> None:
        db.execute("ALTER TABLE jobs ADD COLUMN half INTEGER")
        raise sqlite3.OperationalError("disk I/O error")
    db = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError):
        schema.migrate(db, path, (*STEPS, Step(LATEST + 1, "broken", broken)))
    db.close()
    assert version(path) == 0 and layout(path) == before       # not even the baseline stayed
    assert make_state_db.read_back(path) == expected(FIRST)


def _race(path: Path, first: tuple[Step, ...], second: tuple[Step, ...]) -> dict:
    """`second` opens `path`, reads its version, and is about to take the write lock when `first`
    migrates it (run from the trace callback, which SQLite calls before the statement runs)."""
    a = sqlite3.connect(path, isolation_level=None)
    b = sqlite3.connect(path, isolation_level=None)
    got: dict = {}

    def on_statement(sql: str) -> None:
        if sql == "BEGIN IMMEDIATE" and "first" not in got:
            got["first"] = schema.migrate(a, path, first)
    b.set_trace_callback(on_statement)
    try:
        got["second"] = schema.migrate(b, path, second)
    except SchemaTooNew as e:
        got["second"] = e
    finally:
        a.close()
        b.close()
    return got


def test_an_opener_that_finds_the_database_migrated_once_it_holds_the_lock_does_nothing(tmp_path):
    path = saved(RELEASE, tmp_path / "state.db")
    steps = (*STEPS, _probe("once"))      # a step that fails when run twice
    got = _race(path, steps, steps)
    assert got == {"first": list(range(1, LATEST + 2)), "second": []}
    assert version(path) == LATEST + 1


def test_an_opener_that_finds_a_newer_version_once_it_holds_the_lock_refuses(tmp_path):
    path = saved(RELEASE, tmp_path / "state.db")
    got = _race(path, (*STEPS, _probe("newer")), STEPS)
    assert isinstance(got["second"], SchemaTooNew) and got["second"].found == LATEST + 1
    assert got["first"] == list(range(1, LATEST + 2)) and version(path) == LATEST + 1


OPENER = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from gpuswap.node.store import Store
print("ready", flush=True)
sys.stdin.read()                      # the gate: every opener starts when the test closes it
store = Store(sys.argv[1])
print("opened", len(store.list()), flush=True)
store.close()
"""


@pytest.mark.parametrize("start", ["old-wal", "old-rollback-journal", "empty"])
def test_processes_opening_a_database_at_once_migrate_it_once(tmp_path, start):
    """The old database as the daemon left it (WAL), or restored into a rollback journal; or the
    empty file the daemon's home starts with. Switching the latter two to WAL needs a lock SQLite
    does not wait for."""
    path = tmp_path / "state.db"
    if start == "empty":
        path.touch()
    else:
        saved(FIRST, path)
        if start == "old-wal":
            db = sqlite3.connect(path)
            db.execute("PRAGMA journal_mode=WAL")
            db.close()
    gate, opener = os.pipe()               # one gate for all: their stdin ends when the test closes it
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, str(path)], stdin=gate, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    os.close(gate)
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
    finally:
        os.close(opener)
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert [p.returncode for p in procs] == [0] * 4, outs
    assert sorted(out.count("schema upgraded from version 0") for out, _ in outs) == [0, 0, 0, 1], outs
    jobs = 0 if start == "empty" else 11
    assert all(out.endswith(f"opened {jobs}\n") for out, _ in outs), outs
    if start != "empty":
        assert make_state_db.read_back(path) == expected(FIRST)
    assert version(path) == LATEST


def test_the_switch_to_wal_waits_for_another_opener_instead_of_failing(tmp_path):
    """SQLite answers 'database is locked' at once, without busy_timeout, when a rollback-journal
    file cannot be switched to WAL because another connection is writing: the store tries again."""
    from gpuswap.node.store import _wal

    path = saved(FIRST, tmp_path / "state.db")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")            # another opener, mid-write
    tries: list[str] = []

    def on_statement(sql: str) -> None:
        tries.append(sql)
        if len(tries) == 2:                     # the first try was refused: the other one finishes
            other.execute("COMMIT")
    db = sqlite3.connect(path, isolation_level=None)
    db.set_trace_callback(on_statement)
    _wal(db)
    assert tries == ["PRAGMA journal_mode=WAL"] * 2
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    other.close()


def test_version_4_adds_the_runtime_estimate_and_old_finished_jobs_feed_the_predictor(tmp_path):
    """A database at version 2 (before runtime estimates) gains --time and the estimate columns;
    its jobs read as having neither, and its completed jobs are the history the predictor learns
    from at once (no table to fill: the finished rows are it)."""
    path = saved(RELEASE, tmp_path / "state.db")
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, STEPS[:2]) == [1, 2]
    db.close()
    assert version(path) == 2
    store = Store(path)
    try:
        assert version(path) == LATEST
        jobs = store.list()
        assert jobs and all((j.time_limit_s, j.estimate_s, j.estimate_from, j.estimate_runs) == (None, None, None, 0)
                            for j in jobs)
        done = [j for j in jobs if j.state.value == "COMPLETED" and j.end_time is not None]
        assert done, "the saved release has a completed job"
        j = max(done, key=lambda j: (j.end_time, j.id))
        same, any_name = store.finished_runs(j.uid, j.name, 5)
        assert same[-1] == j.run_s and any_name[-1] == j.run_s
        [new] = store.add_jobs([NewJob(name="train", user="u", uid=1, gid=1, argv=["true"], cwd="/", env={},
                                       priority=1, gpus=1, mem_bytes=0, time_limit_s=3600.0, estimate_s=3600.0,
                                       estimate_from="time")], 1.0)
        got = store.get(new)
        assert (got.time_limit_s, got.estimate_s, got.estimate_from, got.estimate_runs) == (3600.0, 3600.0, "time", 0)
    finally:
        store.close()


def test_version_7_keeps_a_single_daemons_bandwidths_as_its_own_and_adds_each_nodes(tmp_path):
    """A database at version 6 (one set of learned figures) reads back the same figures as the
    daemon's own machine's (node ''), with their samples; a pool node's are kept apart under its
    name, and neither overwrites the other."""
    path = saved(RELEASE, tmp_path / "state.db")
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, STEPS[:6]) == [1, 2, 3, 4, 5, 6]
    db.execute("INSERT INTO bandwidths (field,bytes_per_s,samples,updated) VALUES ('disk_read_bps',3e9,4,5.0)")
    before = {r[0]: (r[1], r[2]) for r in db.execute("SELECT field,bytes_per_s,samples FROM bandwidths")}
    db.close()
    assert version(path) == 6 and len(before) == 3       # the release's two and the one above
    store = Store(path)
    try:
        assert version(path) == LATEST
        assert store.load_bandwidths() == before
        assert store.load_bandwidths("node-b") == {}
        store.save_bandwidth("disk_read_bps", 1e8, 1, 6.0, node="node-b")
        store.save_bandwidth("disk_read_bps", 2e9, 5, 7.0)
        assert store.load_bandwidths("node-b") == {"disk_read_bps": (1e8, 1)}
        assert store.load_bandwidths()["disk_read_bps"] == (2e9, 5)
    finally:
        store.close()
    assert layout(path) == layout(fresh(tmp_path / "fresh.db"))


def test_version_10_gives_kept_runs_the_uid_of_their_names_jobs_where_there_is_one(tmp_path):
    """The predictor learns by uid (an account made again under a deleted one's name learns nothing
    from the first one's runs). A run the sweep kept before gains the uid its name's recorded jobs
    all have; with none recorded, or two uids under the name, it would predict for nobody: dropped."""
    path = tmp_path / "state.db"
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, STEPS[:9]) == list(range(1, 10))
    db.close()
    store = Store(path)          # at version 10 from here; the rows below are as version 9 left them
    try:
        store.add_jobs([NewJob(name="x", user=user, uid=uid, gid=uid, argv=["true"], cwd="/", env={}, priority=1,
                               gpus=1, mem_bytes=0) for user, uid in (("carol", 1009), ("erin", 1010), ("erin", 1011))],
                       1.0)
    finally:
        store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.executemany("INSERT INTO kept_runs (job_id,user,name,run_s,end_time) VALUES (?,?,?,?,?)",
                   [(100, "carol", "train", 60.0, 5.0), (101, "dave", "train", 70.0, 6.0),
                    (102, "erin", "train", 80.0, 7.0)])
    db.execute("PRAGMA user_version=9")
    assert schema.migrate(db, path, STEPS) == [10]
    assert db.execute("SELECT job_id, uid FROM kept_runs ORDER BY job_id").fetchall() == [(100, 1009)]
    indexes = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert not indexes & {"kept_runs_family", "kept_runs_user", "jobs_user_end"}, indexes
    db.close()
    store = Store(path)
    try:
        assert store.finished_runs(1009, "train", 5) == ([60.0], [60.0])
        assert store.finished_runs(1010, "train", 5) == ([], [])
    finally:
        store.close()
