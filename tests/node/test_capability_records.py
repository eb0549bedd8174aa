"""The daemon's records in policy/capability.py's terms: a one-process job keeps the tiers and
mechanism it had before capability.py existed; a job whose runtime reported several ranks is
never offered the driver path; the ranks reach the record from the runtime's `world_size`."""
import dataclasses
import itertools
import time
from pathlib import Path

from gpuswap.node.freezer import job_parkability, mechanism_for, tiers_for
from gpuswap.protocol.status import RankFact, runtime_facts
from gpuswap.node.observe import Observer
from gpuswap.node.snapshot import job_view
from gpuswap.node.store import NewJob, Store
from gpuswap.policy.capability import NCCL_TRANSPARENT_REFUSAL


def _old_tiers(job, transparent_ok: bool) -> frozenset:
    """The rule before capability.py (freezer.mechanism_for + tiers_for at 43b4d54), the reference."""
    driver_ok = transparent_ok and not job.transparent_refused
    if job.pause_mode == "cooperative":
        mech = "cooperative"
    elif job.pause_mode == "transparent":
        mech = "transparent" if driver_ok else None
    elif job.attached:
        mech = "cooperative"
    else:
        mech = "transparent" if driver_ok else "cooperative"
    if mech == "cooperative" and not job.no_runtime:
        return frozenset({"ram", "disk"})
    return frozenset({"ram"}) if mech == "transparent" else frozenset()


def _record(tmp_path: Path):
    store = Store(tmp_path / "state.db")
    [job_id] = store.add_jobs([NewJob("t", "u", 0, 0, ["true"], "/", {}, 0, 4, 2**30)], time.time())
    return store, job_id


def test_one_process_jobs_keep_their_tiers(tmp_path):
    store, job_id = _record(tmp_path)
    base = store.get(job_id)
    assert base.width == 1
    for mode, attached, no_runtime, refused, ok in itertools.product(
            ("auto", "cooperative", "transparent"), (False, True), (False, True), (None, "lock timed out"),
            (False, True)):
        j = dataclasses.replace(base, pause_mode=mode, attached=attached, no_runtime=no_runtime,
                                transparent_refused=refused)
        assert tiers_for(j, ok) == _old_tiers(j, ok), (mode, attached, no_runtime, refused, ok)
        assert job_parkability(j, ok).mechanism in ("cooperative", "transparent", "none")


def test_a_multi_rank_job_is_never_offered_the_driver(tmp_path):
    store, job_id = _record(tmp_path)
    j = dataclasses.replace(store.get(job_id), width=4)
    assert mechanism_for(j, True) == "cooperative" and tiers_for(j, True) == frozenset({"ram", "disk"})
    t = dataclasses.replace(j, pause_mode="transparent")
    assert mechanism_for(t, True) is None and tiers_for(t, True) == frozenset()
    view = job_view(t, transparent_ok=True)
    assert view.width == 4 and view.tiers == frozenset() and view.why_not == NCCL_TRANSPARENT_REFUSAL


def test_the_runtimes_world_size_becomes_the_jobs_width(tmp_path):
    store, job_id = _record(tmp_path)
    observer = Observer(store, None, None, None, 60.0, "wait")
    observer._track_usage(store.get(job_id), runtime_facts({"attached": True, "world_size": 4}), time.time())
    assert store.get(job_id).width == 4
    for bad in (0, 5000, True, "8", None):          # out of bounds or not a number: ignored
        observer._track_usage(store.get(job_id), runtime_facts({"world_size": bad}), time.time())
        assert store.get(job_id).width == 4


def test_a_ranks_ram_refusal_makes_the_job_disk_only_and_says_why(tmp_path):
    store, job_id = _record(tmp_path)
    observer = Observer(store, None, None, None, 60.0, "wait")
    # as the supervisor's status.json lists them once protocol/status.py has validated them
    ranks = [RankFact(rank=0).model_dump(), RankFact(rank=1, ram_refusal="FSDP1 module").model_dump()]
    observer._track_usage(store.get(job_id), runtime_facts({"attached": True, "world_size": 2, "ranks": ranks}),
                          time.time())
    j = store.get(job_id)
    assert j.ram_refusal == "rank 1: FSDP1 module"
    assert tiers_for(j, False) == frozenset({"disk"})
    assert job_view(j).why_not == "no RAM park: rank 1: FSDP1 module; parks to disk"
    observer._track_usage(j, runtime_facts({"ranks": [RankFact(rank=0).model_dump(), RankFact(rank=1).model_dump()]}),
                          time.time())   # the refusal is gone
    assert store.get(job_id).ram_refusal is None and tiers_for(store.get(job_id), False) == frozenset({"ram", "disk"})
