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


def test_the_docs_table_of_what_each_state_carries_is_the_table():
    assert lifecycle.carries_table() in DOC.read_text()


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


def test_a_users_request_on_a_job_that_ended_meanwhile_is_refused_and_its_end_kept(tmp_path):
    """The API reads a job, checks the request, then writes it: a job that ended in between must
    keep its reason and its last event, not take "cancel requested by u" over "exited with code 0"
    (nor a hold). The store checks the request in the write's transaction."""
    store, job = _store(tmp_path)
    pending = (store.get(job), store.events(job))
    for kind in (K.PAUSE_REQUESTED, K.RESUME_REQUESTED):          # a pending job has no process yet
        with pytest.raises(lifecycle.RequestTooLate):
            store.update(job, 2.0, hold=kind is K.PAUSE_REQUESTED, event=NewEvent(kind, "asked", initiator="user"))
    assert (store.get(job), store.events(job)) == pending
    store.update(job, 3.0, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, "started on GPU 0"))
    store.update(job, 4.0, state=JobState.COMPLETED, assigned=[], end_time=4.0, exit_code=0,
                 event=NewEvent(K.COMPLETED, "exited with code 0"))
    ended = (store.get(job), store.events(job))
    for kind, changes in ((K.CANCEL_REQUESTED, dict(cancel_requested=True, hold=False)),
                          (K.PAUSE_REQUESTED, dict(hold=True, hold_tier="ram")), (K.RESUME_REQUESTED, dict(hold=False))):
        with pytest.raises(lifecycle.RequestTooLate) as e:
            store.update(job, 5.0, event=NewEvent(kind, f"{kind.value} by u", initiator="user"), **changes)
        assert e.value.state == JobState.COMPLETED
    assert (store.get(job), store.events(job)) == ended
    assert store.get(job).reason == "exited with code 0"
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


# -- what each state carries (lifecycle.CARRIES) ------------------------------------------------
def _record(**kw):
    """A job record with the fields the table reads (a RUNNING job on GPU 0 unless told)."""
    from types import SimpleNamespace
    base = dict(id=1, state=JobState.RUNNING, gpus=1, assigned=[0], home_gpus=[], parked=None, parked_bytes=0,
                mechanism=None, stopped=False, end_time=None, exit_code=None, signal=None, desired="running",
                desired_tier=None, pause_requested_at=None)
    return SimpleNamespace(**{**base, **kw})


PG_ = dict(state=JobState.PAUSING, mechanism="cooperative", desired="paused", desired_tier="ram", pause_requested_at=5.0)
RAM = dict(state=JobState.PAUSED, parked="ram", parked_bytes=1 << 30, assigned=[], home_gpus=[0], mechanism="cooperative",
           desired="paused", desired_tier="ram")
DISK = dict(state=JobState.PAUSED, parked="disk", parked_bytes=1 << 30, assigned=[], mechanism="cooperative")
STOP = dict(state=JobState.PAUSED, stopped=True, mechanism="cooperative", desired_tier="disk")
END = dict(assigned=[], end_time=9.0)

# (name, record, what is wrong with it: a piece of each violation's text, [] when it fits)
CASES = [
    ("pending, new", _record(state=JobState.PENDING, assigned=[]), []),
    ("pending with a GPU", _record(state=JobState.PENDING), ["PENDING job must hold no GPU"]),
    ("pending with parked data", _record(state=JobState.PENDING, assigned=[], parked="disk"),
     ["PENDING job cannot be parked in 'disk'"]),
    ("running", _record(), []),
    ("running, 2 GPUs", _record(gpus=2, assigned=[0, 1]), []),
    ("running without its GPUs", _record(assigned=[]), ["RUNNING job must hold its 1 GPU(s)"]),
    ("running on one GPU twice", _record(gpus=2, assigned=[0, 0]), ["must hold its 2 GPU(s)"]),
    ("running, still parked", _record(parked="ram"), ["RUNNING job cannot be parked in 'ram'"]),
    ("running with home GPUs left", _record(home_gpus=[0]), ["must have no home GPUs"]),
    ("running, stopped", _record(stopped=True), ["must not be stopped"]),
    ("running, its supervisor asked to park", _record(desired="paused"), ["desired running"]),
    ("running with an exit code", _record(exit_code=0), ["must have no end time, exit code or signal"]),
    ("pausing", _record(**PG_), []),
    ("pausing, SIGSTOP fallback not confirmed yet", _record(**PG_, stopped=True), []),
    ("pausing, the driver's stop step", _record(**dict(PG_, mechanism="transparent"), stopped=True), []),
    ("pausing, no mechanism", _record(**dict(PG_, mechanism=None)), ["must be parked by cooperative or transparent"]),
    ("pausing, no tier asked", _record(**dict(PG_, desired_tier=None)), ["the tier asked for"]),
    ("pausing, no request time", _record(**dict(PG_, pause_requested_at=None)), ["the time it was asked"]),
    ("paused in RAM", _record(**RAM), []),
    ("paused in RAM, spilling", _record(**dict(RAM, desired_tier="disk")), []),
    ("frozen by the driver", _record(**dict(RAM, mechanism="transparent", desired="running"), stopped=True), []),
    ("paused in RAM, stopped without the driver", _record(**RAM, stopped=True), ["stopped only if the driver froze it"]),
    ("paused in RAM, still on its GPU", _record(**dict(RAM, assigned=[0])), ["must hold no GPU"]),
    ("paused in RAM, no home GPU", _record(**dict(RAM, home_gpus=[])), ["must keep its 1 home GPU(s)"]),
    ("paused in RAM, no mechanism", _record(**dict(RAM, mechanism=None)), ["must be parked by cooperative or"]),
    ("paused on disk", _record(**DISK), []),
    ("paused on disk, driver", _record(**dict(DISK, mechanism="transparent")), ["must be parked by cooperative;"]),
    ("paused on disk, home GPU", _record(**dict(DISK, home_gpus=[0])), ["must have no home GPUs"]),
    ("SIGSTOPped", _record(**STOP), []),
    ("paused, neither parked nor stopped", _record(**dict(STOP, stopped=False)), ["must be stopped"]),
    ("SIGSTOPped, no GPU", _record(**dict(STOP, assigned=[])), ["SIGSTOPped) job must hold its 1 GPU(s)"]),
    ("SIGSTOPped, bytes", _record(**dict(STOP, parked_bytes=5)), ["must have nothing parked"]),
    ("resuming from RAM", _record(**dict(RAM, state=JobState.RESUMING, assigned=[1], desired="running")), []),
    ("thawing, still stopped", _record(**dict(RAM, state=JobState.RESUMING, assigned=[0], mechanism="transparent"),
                                       stopped=True), []),
    ("resuming from RAM, no GPU", _record(**dict(RAM, state=JobState.RESUMING)), ["must hold its 1 GPU(s)"]),
    ("resuming from disk", _record(**dict(DISK, state=JobState.RESUMING, assigned=[0])), []),
    ("resuming, nothing parked", _record(state=JobState.RESUMING), ["RESUMING job cannot be parked in None"]),
    ("completed", _record(state=JobState.COMPLETED, exit_code=0, **END), []),
    ("failed by a signal", _record(state=JobState.FAILED, exit_code=137, signal=9, **END), []),
    ("cancelled before it ran", _record(state=JobState.CANCELLED, **END), []),
    ("ended without an end time", _record(state=JobState.FAILED, assigned=[]), ["must have its end time"]),
    ("ended, still on its GPU", _record(state=JobState.COMPLETED, end_time=9.0), ["must hold no GPU"]),
    ("ended, still parked", _record(state=JobState.CANCELLED, parked="ram", **END), ["cannot be parked in 'ram'"]),
    ("ended, still stopped", _record(state=JobState.FAILED, stopped=True, **END), ["must not be stopped"]),
]


@pytest.mark.parametrize("name,record,wrong", CASES, ids=[c[0] for c in CASES])
def test_what_each_state_carries(name, record, wrong):
    got = lifecycle.violations(record)
    assert len(got) == len(wrong) and all(w in g for w, g in zip(wrong, got)), got


def test_every_state_has_a_row_and_every_row_a_case():
    rows = {(c.state, c.parked) for c in lifecycle.CARRIES}
    assert {s for s, _ in rows} == set(JobState)
    fitting = {(JobState(r.state), r.parked) for _, r, wrong in CASES if not wrong}
    assert fitting == rows


def test_the_store_refuses_a_record_its_state_cannot_carry_and_writes_nothing(tmp_path):
    """A real SQLite file: the write that leaves a RUNNING job without its GPUs raises and leaves the
    row (and its events, its version) as they were; so does a job moved to PAUSED with nothing parked."""
    store, job = _store(tmp_path)
    store.update(job, 2.0, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, "started on GPU 0"))
    before = (store.get(job), store.events(job))
    with pytest.raises(lifecycle.InvalidRecord, match=r"job 1 in RUNNING: a RUNNING job must hold its 1 GPU"):
        store.update(job, 3.0, assigned=[])
    with pytest.raises(lifecycle.InvalidRecord, match="a PAUSING job must be parked by cooperative or transparent"):
        store.update(job, 3.0, state=JobState.PAUSING, event=NewEvent(K.PARK_STARTED, "pausing to ram"))
    assert (store.get(job), store.events(job)) == before
    store.update(job, 4.0, step=12)            # what the table does not read is written as before
    assert store.get(job).step == 12
    store.close()
    reopened = Store(tmp_path / "state.db")    # and nothing of the refused writes reached the file
    assert reopened.get(job).assigned == [0] and reopened.get(job).state == JobState.RUNNING
    reopened.close()


def test_a_row_an_older_version_wrote_is_not_stuck_for_what_it_already_broke(tmp_path):
    """A live row that broke a rule before this write (written before the table existed) still takes
    writes that do not break a new one: the daemon can go on with that job after an upgrade."""
    store, job = _store(tmp_path)
    store.update(job, 2.0, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, "started on GPU 0"))
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("UPDATE jobs SET home_gpus='[0]' WHERE id=?", (job,))   # as an older daemon left it
    db.commit()
    db.close()
    store.update(job, 3.0, step=5, device_bytes=1 << 20)
    store.update(job, 4.0, desired="running", event=NewEvent(K.PAUSE_REQUESTED, "pause to ram requested by u"))
    with pytest.raises(lifecycle.InvalidRecord, match="must hold its 1 GPU"):   # a new fault is still refused
        store.update(job, 5.0, assigned=[])
    assert store.get(job).step == 5 and store.get(job).assigned == [0]
    store.close()


def test_a_parked_job_reads_its_park_as_one_record(tmp_path):
    store, job = _store(tmp_path)
    assert store.get(job).parked_state is None
    store.update(job, 2.0, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, "started on GPU 0"))
    store.update(job, 3.0, state=JobState.PAUSING, mechanism="transparent", desired_tier="ram", pause_requested_at=3.0,
                 event=NewEvent(K.PARK_STARTED, "freezing through the driver"))
    store.update(job, 4.0, state=JobState.PAUSED, parked="ram", parked_bytes=3 << 30, home_gpus=[0], assigned=[],
                 stopped=True, event=NewEvent(K.FROZEN, "frozen transparently"))
    assert store.get(job).parked_state == Parked("ram", "transparent", 3 << 30, (0,))
    store.close()
