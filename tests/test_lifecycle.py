"""The lifecycle table (gpuswap/lifecycle.py): the store enforces it, the docs draw it, the API's
checks and the simulator's phases follow it."""
from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from gpuswap import lifecycle
from gpuswap.jobs import JobState
from gpuswap.lifecycle import EDGES, NOTES, EventKind as K, IllegalTransition, NewEvent, Parked
from gpuswap.node.store import NewJob, Store

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_docs_diagram_is_the_table():
    blocks = re.findall(r"```mermaid\n(.*?)```", DOC.read_text(), re.S)
    assert blocks == [lifecycle.mermaid()]


def test_every_kind_is_an_edge_or_a_note_and_no_edge_is_ambiguous():
    moving = {e.kind for e in EDGES}
    assert moving | NOTES == set(K) and not moving & NOTES
    keys = [(e.source, e.kind) for e in EDGES]
    assert len(keys) == len(set(keys))
    assert not any(e.source is not None and e.source.terminal for e in EDGES)   # nothing leaves an end


def test_the_apis_checks_follow_the_table():
    for s in JobState:
        assert lifecycle.may_cancel(s) == (not s.terminal)
        assert lifecycle.may_pause(s) == lifecycle.may_resume(s) == (s not in (JobState.PENDING,) and not s.terminal)


def _store(tmp_path: Path) -> tuple[Store, int]:
    store = Store(tmp_path / "state.db")
    [job] = store.add_jobs([NewJob("j", "u", 1, 1, ["true"], "/", {}, 1, 1, 0)], 1.0)
    return store, job


def test_the_store_refuses_an_illegal_edge_and_writes_nothing(tmp_path):
    store, job = _store(tmp_path)
    before = (store.get(job), store.events(job))
    for event, changes in ((NewEvent(K.PARKED_RAM, "parked in RAM"), dict(state=JobState.PAUSED, parked="ram")),
                           (NewEvent(K.STARTED, "started"), dict(state=JobState.PAUSED)),   # wrong target
                           ("a sentence alone", dict(state=JobState.RUNNING)),             # no kind
                           (NewEvent(K.SPILL_REQUESTED, "spill"), {}),                     # PENDING has no spill
                           (None, dict(state=JobState.COMPLETED))):
        with pytest.raises(IllegalTransition):
            store.update(job, 2.0, event=event, **changes)
    assert (store.get(job), store.events(job)) == before
    store.update(job, 3.0, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, "started on GPU 0"))
    store.update(job, 4.0, event=NewEvent(K.PAUSE_REQUESTED, "pause to ram requested by u", tier="ram",
                                          initiator="user"))          # a note: no state change
    store.update(job, 5.0, state=JobState.PAUSING, mechanism="cooperative", desired="paused", desired_tier="ram",
                 pause_requested_at=5.0, event=NewEvent(K.PARK_STARTED, "pausing to ram", tier="ram",
                                                        mechanism="cooperative", initiator="user"))
    store.update(job, 6.0, state=JobState.PAUSED, parked="ram", parked_bytes=1 << 30, home_gpus=[0], assigned=[],
                 mechanism="cooperative", event=NewEvent(K.PARKED_RAM, "parked in RAM: 1.0 GiB"))
    assert Parked.of(store.get(job)) == Parked("ram", "cooperative", 1 << 30, (0,))
    events = store.events(job)
    assert [(e.state, e.kind, e.tier, e.mechanism, e.initiator) for e in events] == [
        ("PENDING", "submitted", None, None, None), ("RUNNING", "started", None, None, None),
        ("RUNNING", "pause_requested", "ram", None, "user"), ("PAUSING", "park_started", "ram", "cooperative", "user"),
        ("PAUSED", "parked_ram", "ram", "cooperative", None)]      # the kind implies the tier and mechanism
    assert [r.kind for r in store.events_after(0)] == [e.kind for e in events]
    store.close()


def test_old_events_get_their_kind_once_from_their_wording(tmp_path):
    """A database from before events had kinds (schema version 1): the migration infers kind, tier,
    mechanism and initiator from the wording of that time; a sentence it does not know stays NULL."""
    path = tmp_path / "state.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version=1")
    for c in ("kind", "tier", "mechanism"):
        db.execute(f"ALTER TABLE events DROP COLUMN {c}")
    db.executemany("INSERT INTO events (job_id,time,state,reason,initiator) VALUES (?,?,?,?,?)", [
        (5, 1, "PAUSING", "freezing through the driver: preempted for job 9", None),
        (5, 2, "PAUSED", "frozen transparently: 1.0 GiB of CUDA process 12 moved", None),
        (6, 1, "PAUSED", "parked in RAM: 1.0 GiB freed", None),
        (6, 2, "PAUSED", "spill to disk requested by alice", None),
        (6, 3, "PAUSED", "parked to disk: checkpoint of 1.0 GiB", None),
        (7, 1, "PAUSING", "pausing to disk: requested by user", None),
        (7, 2, "PAUSED", "parked to disk: checkpoint of 1.0 GiB", None),
        (7, 3, "RUNNING", "ranks agreed", None)])
    db.commit()
    db.close()
    store = Store(path)
    rows = [(r.job_id, r.kind, r.tier, r.mechanism, r.initiator) for r in store.events_after(0)]
    store.close()
    assert rows == [(5, "park_started", "ram", "transparent", "policy"), (5, "frozen", "ram", "transparent", None),
                    (6, "parked_ram", "ram", "cooperative", None), (6, "spill_requested", "disk", "cooperative", "user"),
                    (6, "spilled", "disk", "cooperative", None),
                    (7, "park_started", "disk", "cooperative", "user"), (7, "parked_disk", "disk", "cooperative", None),
                    (7, None, None, None, None)]
