"""Write a state database with the gpuswap on PYTHONPATH, as a release left it, for the migration
tests (tests/node/test_schema_migrations.py). Run it with the *release's* source on PYTHONPATH:

    git archive <commit> src | tar -x -C /tmp/rel
    PYTHONPATH=/tmp/rel/src python tests/data/statedb/make_state_db.py tests/data/statedb/<name>

It writes <name>.sql (the database as `iterdump()` gives it, plus its `user_version`) and
<name>.json (everything that release's Store reads back from it: the migrated database must read
the same). It uses only the Store API, and only the parts the release has, so one script serves
every release; every job column is given a value other than its default somewhere.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import sqlite3
import sys
import tempfile
from pathlib import Path

import gpuswap.node.store as store_module
from gpuswap.jobs import JobState
from gpuswap.node.store import NewJob, Store

T0 = 1764000000.123456       # fixed times: the files are the same at every run
FIELDS = {f.name for f in dataclasses.fields(store_module.JobRecord)}
INITIATOR = "initiator" in inspect.signature(Store.update).parameters


def new(name: str, argv: list[str], env: dict[str, str], **kw) -> NewJob:
    return NewJob(name=name, user=kw.pop("user", "alice"), uid=kw.pop("uid", 1001), gid=kw.pop("gid", 1001),
                  argv=argv, cwd="/home/alice/exp", env=env, priority=kw.pop("priority", 1),
                  gpus=kw.pop("gpus", 1), mem_bytes=kw.pop("mem_bytes", 6 << 30), **kw)


def update(store: Store, job: int, t: float, event: str | None = None, initiator: str | None = None,
           **changes) -> None:
    changes = {k: v for k, v in changes.items() if k in FIELDS}   # columns this release has
    extra = {"initiator": initiator} if INITIATOR and initiator else {}
    store.update(job, T0 + t, event=event, **extra, **changes)


def fill(store: Store) -> None:
    ids = store.add_jobs([
        new("queued", ["python", "train.py", "--lr", "3e-4", "héllo wörld ✓", "a\nb", "it's"],
            {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "NOTE": "ünïcode ✓"}, priority=3),
        new("running-2rank", ["torchrun", "--nproc-per-node", "2", "ddp.py"], {"PATH": "/usr/bin"}, gpus=2),
        new("paused-ram", ["python", "a.py"], {"SEED": "1"}, user="bob", uid=1002, gid=1002),
        new("paused-disk", ["python", "b.py"], {}, pause_mode="transparent", preemptible=True),
        new("stopped", ["./legacy.sh"], {"X": "1"}, priority=0),
        new("pausing", ["python", "c.py"], {}),
        new("resuming", ["python", "d.py"], {}),
        new("completed", ["true"], {"SECRET": "gone-when-ended"}),
        new("failed", ["python", "oom.py"], {}, preemptible=False, pause_mode="cooperative"),
        new("cancelled", ["sleep", "1000"], {}),
        new("forgotten", ["true"], {}),
    ], T0)
    queued, running, ram, disk, stopped, pausing, resuming, done, failed, cancelled, forgotten = ids
    update(store, queued, 1, hold=True, reason="held by alice")
    for n, j in enumerate(ids[1:], 2):        # everything else started once
        update(store, j, n, event=f"started on GPU {n % 2}", state=JobState.RUNNING, assigned=[n % 2],
               home_gpus=[n % 2], last_start=T0 + n, generation=1, attached=True, mechanism="cooperative")
    update(store, running, 20, event="ranks agreed", assigned=[0, 1], home_gpus=[0, 1], width=2, step=41,
           device_bytes=3 << 30, ranks=[{"rank": 0, "pid": 4242, "state": "running", "connected": True,
                                         "device_bytes": 3 << 30},
                                        {"rank": 1, "pid": 4243, "state": "running", "connected": True,
                                         "device_bytes": 3 << 30}])
    update(store, ram, 21, event="pausing to ram: the policy's choice", initiator="policy", state=JobState.PAUSING,
           desired="paused", desired_tier="ram", pause_requested_at=T0 + 21.5, ram_allowance=8 << 30)
    update(store, ram, 22, event="parked in RAM at step 1200", state=JobState.PAUSED, parked="ram",
           parked_bytes=5 << 30, assigned=[], step=1200, preemptions=2, residue={0: 1 << 20, 1: 4096})
    update(store, disk, 23, event="pausing to disk: requested by user", initiator="user", state=JobState.PAUSING,
           desired="paused", desired_tier="disk", mechanism="transparent", pause_requested_at=T0 + 23)
    update(store, disk, 24, event="parked on disk", state=JobState.PAUSED, parked="disk", parked_bytes=7 << 30,
           assigned=[], step=77, ram_refusal="rank 1: NCCL communicator cannot be rebuilt",
           transparent_refused=None)
    update(store, stopped, 25, event="no gpuswap runtime: stopped (SIGSTOP)", state=JobState.PAUSED, stopped=True,
           no_runtime=True, attached=False, mechanism=None)
    update(store, pausing, 26, event="pausing to ram: requested by user", initiator="user", state=JobState.PAUSING,
           desired="paused", desired_tier="ram", pause_requested_at=T0 + 26)
    update(store, resuming, 27, event="pausing to ram", state=JobState.PAUSED, parked="ram", parked_bytes=1 << 30)
    update(store, resuming, 28, event="resuming on GPU 1", state=JobState.RESUMING, desired="running",
           desired_tier=None, assigned=[1], home_gpus=[1])
    update(store, done, 29, event="exited with code 0", state=JobState.COMPLETED, exit_code=0, end_time=T0 + 29,
           assigned=[])
    update(store, failed, 30, event="killed by signal 9", state=JobState.FAILED, signal=9, end_time=T0 + 30,
           abort_reason="out of host memory while parking",
           transparent_refused="cuda-checkpoint: the job holds CUDA IPC memory", assigned=[])
    update(store, cancelled, 31, event="cancelled by alice", state=JobState.CANCELLED, cancel_requested=True,
           end_time=T0 + 31, assigned=[])
    update(store, forgotten, 32, event="exited with code 0", state=JobState.COMPLETED, exit_code=0,
           end_time=T0 + 32, assigned=[])
    if hasattr(store, "delete_finished"):   # the retention sweep: its id is never given again
        store.delete_finished(forgotten)
    store.accrue([(running, 123.25, 61.625, 0.5), (ram, 3600.0, 3500.0, 12.75), (done, 1.0, 1.0, 0.0)])
    if hasattr(store, "add_event"):
        store.add_event(queued, T0 + 40, JobState.PENDING, "waiting: 2 GPUs busy (jobs 2, 3)")
    for n, (kind, job) in enumerate([("preempt", ram), ("start", running), ("spill", disk)]):
        store.record_decision(T0 + 50 + n, kind, job, {"gpus": [0], "why": f"decision {n}", "score": 0.25 * n})
    store.save_usage({"alice": 9876.5, "bob": 0.125}, T0 + 60)
    store.save_bandwidth("disk_write", 1.5e9, 3, T0 + 61)
    store.save_bandwidth("ram_read", 2.25e10, 1, T0 + 62)
    store.add_token("a1b2c3", "alice", 1001, "0" * 64, T0 + 63, "root", note="laptop")
    store.add_token("d4e5f6", "bob", 1002, "f" * 64, T0 + 64, "bob")


def read_back(path: Path) -> dict:
    """What the Store of the release on PYTHONPATH reads from the database at `path`."""
    store = Store(path)
    try:
        jobs = store.list()
        db = sqlite3.connect(path)
        decisions = [list(r) for r in db.execute("SELECT id,time,kind,job_id,detail FROM decisions ORDER BY id")]
        sequence = dict(db.execute("SELECT name, seq FROM sqlite_sequence"))
        db.close()
        return {
            "jobs": [json.loads(json.dumps(dataclasses.asdict(j))) for j in jobs],
            "env": {str(j.id): store.env(j.id) for j in jobs},
            "events": {str(j.id): [dataclasses.asdict(e) for e in store.events(j.id)] for j in jobs},
            "events_after": [list(e) for e in store.events_after(0)],
            "decisions": decisions,
            "usage": store.load_usage(),
            "bandwidths": {k: list(v) for k, v in store.load_bandwidths().items()},
            "tokens": store.tokens(),
            "sqlite_sequence": sequence,
        }
    finally:
        store.close()


def dump(path: Path) -> str:
    db = sqlite3.connect(path)
    version = db.execute("PRAGMA user_version").fetchone()[0]
    text = "\n".join(db.iterdump()) + "\n"
    db.close()
    return text + (f"PRAGMA user_version={version};\n" if version else "")   # iterdump leaves it out


def main(prefix: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.db"
        store = Store(path)
        fill(store)
        store.close()
        expected = read_back(path)
        text = dump(path)
        again = Path(tmp) / "again.db"            # the dump must hold the whole database
        db = sqlite3.connect(again)
        db.executescript(text)
        db.close()
        assert read_back(again) == expected, "the dump does not read back the same"
    prefix.with_suffix(".sql").write_text(text)
    prefix.with_suffix(".json").write_text(json.dumps(expected, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
