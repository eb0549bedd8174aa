"""Events carry their kind, tier, mechanism and initiator; the API shows them, and the metrics fold
them, never the sentence: rewording every sentence changes no count."""
from __future__ import annotations

from pathlib import Path

from gpuswap.api.metrics import EventFold
from gpuswap.api.views import job_record
from gpuswap.jobs import JobState
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node.store import NewJob, Store


def _history(store: Store, job: int, say) -> None:
    """A user's pause to RAM, a policy spill to disk, a restart from disk, and the end."""
    store.update(job, 2, state=JobState.RUNNING, assigned=[0], event=NewEvent(K.STARTED, say("start")))
    store.update(job, 3, state=JobState.PAUSING, mechanism="cooperative", desired="paused", desired_tier="ram",
                 pause_requested_at=3, event=NewEvent(K.PARK_STARTED, say("pause"), tier="ram",
                                                      mechanism="cooperative", initiator="user"))
    store.update(job, 4, state=JobState.PAUSED, parked="ram", parked_bytes=1 << 20, home_gpus=[0], assigned=[],
                 event=NewEvent(K.PARKED_RAM, say("parked")))
    store.update(job, 5, desired_tier="disk", pause_requested_at=5,
                 event=NewEvent(K.SPILL_REQUESTED, say("spill"), initiator="policy"))
    store.update(job, 7, state=JobState.PAUSED, parked="disk", home_gpus=[], desired="running", desired_tier=None,
                 event=NewEvent(K.SPILLED, say("spilled")))
    store.update(job, 8, state=JobState.RESUMING, assigned=[0], event=NewEvent(K.RESUME_STARTED, say("resume"),
                                                                             tier="disk"))
    store.update(job, 10, state=JobState.RUNNING, parked=None, parked_bytes=0,
                 event=NewEvent(K.RESTARTED_DISK, say("restarted")))
    store.update(job, 11, state=JobState.COMPLETED, end_time=11, exit_code=0, assigned=[],
                 event=NewEvent(K.COMPLETED, say("done")))


def _fold(tmp_path: Path, say) -> EventFold:
    store = Store(tmp_path / f"{say('x')}.db")
    [job] = store.add_jobs([NewJob("j", "u", 1, 1, ["true"], "/", {}, 1, 1, 0)], 1.0)
    _history(store, job, say)
    fold = EventFold()
    fold.advance(store)
    store.close()
    return fold


def test_the_metrics_read_the_fields_not_the_sentences(tmp_path):
    folds = [_fold(tmp_path, lambda what: what), _fold(tmp_path, lambda what: f"reworded {what[::-1]}")]
    for f in folds:
        assert f.user_pauses == {("cooperative", "ram"): 1} and f.preemptions == {}
        assert f.spills == {"policy": 1}
        assert f.park["ram"].counts != f.park["disk"].counts and sum(f.park["disk"].counts) == 1
        assert sum(f.resume["disk"].counts) == 1 and f.finished == {"COMPLETED": 1}
    a, b = folds
    assert (a.park["disk"].total, a.resume["disk"].total) == (b.park["disk"].total, b.resume["disk"].total) == (2, 2)


def test_the_apis_events_and_records_carry_the_fields(tmp_path):
    store = Store(tmp_path / "state.db")
    [job] = store.add_jobs([NewJob("j", "u", 1, 1, ["true"], "/", {}, 1, 1, 0)], 1.0)
    _history(store, job, lambda what: what)
    out = job_record(store.get(job), 12.0, store.events(job), gpus_simulated=True)
    assert out["ended"] is True
    assert [(e["kind"], e["tier"], e["mechanism"], e["initiator"]) for e in out["events"]] == [
        ("submitted", None, None, None), ("started", None, None, None), ("park_started", "ram", "cooperative", "user"),
        ("parked_ram", "ram", "cooperative", None), ("spill_requested", "disk", "cooperative", "policy"),
        ("spilled", "disk", "cooperative", None), ("resume_started", "disk", None, None),
        ("restarted_disk", "disk", "cooperative", None), ("completed", None, None, None)]
    store.close()
