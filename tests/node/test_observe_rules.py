"""The observer's rules as a table (node/observe.py's `decide`): a job's record, what its supervisor
reported and the time in, the transitions out (the record's changes, the event, the side effects).
No daemon, no processes, no clock: every row is a fact and the decision it must give. Each decided
state change is also checked against the lifecycle table, which the store enforces."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest

from gpuswap import lifecycle
from gpuswap.jobs import REQUEUE_EXIT_CODE, JobState
from gpuswap.lifecycle import EventKind as K
from gpuswap.node.launcher import Observation
from gpuswap.node.observe import Facts, Rules, Verdict, _after, decide, reads_status, wants_residue
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import KillProcesses, RemoveCheckpoints, Sample

T = 10_000.0                       # the fake clock: "now" in every row
RULES = Rules(pause_timeout_s=30.0, no_runtime="wait", attach_grace_s=30.0)
SIGSTOP = Rules(pause_timeout_s=30.0, no_runtime="sigstop", attach_grace_s=30.0)
SLOW_START = Rules(pause_timeout_s=30.0, no_runtime="wait", attach_grace_s=120.0)   # --attach-grace 2m
P, R, PG, PD, RS = JobState.PENDING, JobState.RUNNING, JobState.PAUSING, JobState.PAUSED, JobState.RESUMING
GiB = 1 << 30


def job(**kw: Any) -> JobRecord:
    base = dict(id=7, name="j", user="u", uid=1, gid=1, argv=["x"], cwd="/", priority=1, gpus=1, mem_bytes=0,
                preemptible=True, state=R, reason="started on GPU 0", exit_code=None, signal=None,
                submit_time=T - 500, state_since=T - 100, last_start=T - 100, end_time=None, attained_gpu_s=0.0,
                run_s=0.0, switch_s=0.0, assigned=[0], home_gpus=[], parked=None, parked_bytes=0, device_bytes=0,
                generation=1, desired="running", desired_tier=None, pause_requested_at=None, hold=False,
                no_runtime=False, stopped=False, cancel_requested=False, preemptions=0, step=None,
                pause_mode="auto", mechanism=None, attached=True, transparent_refused=None, abort_reason=None,
                ram_allowance=None, residue={}, ranks=[], version=1)
    base.update(kw)
    return JobRecord(**base)


PAUSING = dict(state=PG, mechanism="cooperative", desired="paused", desired_tier="ram", pause_requested_at=T - 5)
PARKED_RAM = dict(state=PD, parked="ram", parked_bytes=4 * GiB, home_gpus=[0], assigned=[], mechanism="cooperative")
PARKED_DISK = dict(state=PD, parked="disk", parked_bytes=4 * GiB, assigned=[], mechanism="cooperative")
RESUMING_RAM = dict(PARKED_RAM, state=RS, assigned=[0])
RESUMING_DISK = dict(PARKED_DISK, state=RS, assigned=[0], generation=2)
ENDED = dict(assigned=[], stopped=False, desired="running", desired_tier=None, parked=None, parked_bytes=0,
             home_gpus=[])


def seen(runtime: Optional[dict] = None, exit: Optional[dict] = None, alive: bool = True, stopped: bool = False,
         spawned_at: Optional[float] = T - 100, delivered: Optional[float] = T - 100, **status: Any) -> Observation:
    """`delivered`: when desired.json asked the supervisor for the pause (read only while PAUSING)."""
    st: dict[str, Any] = {"job_pid": 4242, "stopped": stopped, "runtime": runtime or {}, **status}
    if exit is not None:
        st["exit"] = exit
    return Observation(st, alive, spawned_at, pause_delivered_at=delivered)


# (name, record, facts, rules, [(changes, kind, text, effects), ...] at T unless `at` given)
ROWS: list[tuple[str, JobRecord, Facts, Rules, list[tuple]]] = [
    ("pending: nothing to read", job(state=P, generation=0, assigned=[]), Facts(None), RULES, []),
    ("pending, cancelled", job(state=P, generation=0, assigned=[], cancel_requested=True), Facts(None), RULES,
     [(dict(end_time=T, state=JobState.CANCELLED, assigned=[], parked=None, parked_bytes=0), K.CANCELLED,
       "cancelled before it ran", (RemoveCheckpoints(7),))]),
    ("parked on disk, cancelled", job(**PARKED_DISK, cancel_requested=True), Facts(None), RULES,
     [(dict(end_time=T, state=JobState.CANCELLED, assigned=[], parked=None, parked_bytes=0), K.CANCELLED,
       "cancelled while parked on disk", (RemoveCheckpoints(7),))]),
    ("running, nothing new", job(), Facts(seen({"attached": True})), RULES, []),
    ("running, usage and attach", job(attached=False), Facts(seen({"attached": True, "state": "running",
                                                                  "device_bytes": 3 * GiB, "step": 12})), RULES,
     [(dict(attached=True, device_bytes=3 * GiB, step=12), None, None, ())]),
    ("running, multi-rank width learned", job(), Facts(seen({"world_size": 2})), RULES, [(dict(width=2), None, None, ())]),
    ("started, not spawned yet", job(), Facts(seen(alive=False, spawned_at=None)), RULES, []),
    ("supervisor still starting", job(), Facts(Observation(None, False, T - 1)), RULES, []),
    ("supervisor died, processes left", job(), Facts(seen(alive=False, job_start_ticks=99), orphans=2), RULES,
     [({}, None, None, (KillProcesses(4242, 99, 1, ()),))]),
    ("supervisor died, nothing left", job(), Facts(seen(alive=False)), RULES,
     [(dict(end_time=T, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, home_gpus=[],
            stopped=False), K.FAILED,
       "its supervisor died without recording an exit status; its processes were killed", ())]),
    ("supervisor of a RAM-parked job died", job(**PARKED_RAM), Facts(seen(alive=False)), RULES,
     [(dict(end_time=T, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, home_gpus=[],
            stopped=False), K.FAILED, "its supervisor died without recording an exit status; its processes were "
                                      "killed", ())]),
    ("supervisor died before the job", job(), Facts(Observation({"stopped": False}, False, T - 100)), RULES,
     [(dict(end_time=T, state=JobState.FAILED, assigned=[], parked=None, parked_bytes=0, home_gpus=[],
            stopped=False), K.FAILED,
       "its supervisor died before starting the job", ())]),
    ("exit 0", job(), Facts(seen(exit={"code": 0, "time": T - 3})), RULES,
     [(dict(end_time=T - 3, state=JobState.COMPLETED, exit_code=0, signal=None, **ENDED), K.COMPLETED,
       "exited with code 0", (RemoveCheckpoints(7),))]),
    ("exit 0 while paused in RAM", job(**PARKED_RAM), Facts(seen(exit={"code": 0})), RULES,
     [(dict(end_time=T, state=JobState.COMPLETED, exit_code=0, signal=None, **ENDED), K.COMPLETED,
       "exited with code 0 while paused", (RemoveCheckpoints(7),))]),
    ("exit 3", job(), Facts(seen(exit={"code": 3})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=3, signal=None, **ENDED), K.FAILED, "exited with code 3", ())]),
    ("killed while pausing", job(**PAUSING), Facts(seen(exit={"code": 137, "signal": 9})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=137, signal=9, **ENDED), K.FAILED,
       "killed by SIGKILL while pausing", ())]),
    ("supervisor's own error", job(), Facts(seen(exit={"code": None, "error": "cannot exec: no such file"})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=None, signal=None, **ENDED), K.FAILED,
       "cannot exec: no such file", ())]),
    ("aborted by the daemon", job(abort_reason="thaw failed", cancel_requested=True),
     Facts(seen(exit={"code": 137, "signal": 9})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=137, signal=9, **ENDED), K.FAILED,
       "thaw failed (killed by SIGKILL)", ())]),
    ("cancelled while running", job(cancel_requested=True), Facts(seen(exit={"code": 143, "signal": 15})), RULES,
     [(dict(end_time=T, state=JobState.CANCELLED, exit_code=143, signal=15, **ENDED), K.CANCELLED,
       "killed by SIGTERM after a cancel request", (RemoveCheckpoints(7),))]),
    ("parked to disk", job(**dict(PAUSING, desired_tier="disk")),
     Facts(seen({"state": "checkpointed", "bytes": 2 * GiB, "step": 40, "pause_s": 1.5},
                exit={"code": REQUEUE_EXIT_CODE})), RULES,
     [(dict(state=PD, parked="disk", parked_bytes=2 * GiB, home_gpus=[], step=40, mechanism="cooperative",
            assigned=[], stopped=False, desired="running", desired_tier=None), K.PARKED_DISK,
       "parked to disk: checkpoint of 2.0 GiB at step 40 written in 1.50 s; requeued",
       (Sample("disk_write_bps", 2 * GiB, 1.5),))]),
    ("spilled from RAM to disk", job(**PARKED_RAM, desired_tier="disk"),
     Facts(seen({"state": "checkpointed", "bytes": GiB, "step": 9, "pause_s": 2.0, "ckpt_note": "kept 2"},
                exit={"code": REQUEUE_EXIT_CODE})), RULES,
     [(dict(state=PD, parked="disk", parked_bytes=GiB, home_gpus=[], step=9, mechanism="cooperative",
            assigned=[], stopped=False, desired="running", desired_tier=None), K.SPILLED,
       "parked to disk: checkpoint of 1.0 GiB at step 9 written in 2.00 s; requeued (kept 2)",
       (Sample("disk_write_bps", GiB, 2.0),))]),
    ("checkpoint written after the park was given up", job(no_runtime=True),
     Facts(seen({"state": "checkpointed", "bytes": GiB, "step": 3, "pause_s": 1.0}, exit={"code": REQUEUE_EXIT_CODE})),
     RULES,
     [(dict(state=PD, parked="disk", parked_bytes=GiB, home_gpus=[], step=3, mechanism="cooperative",
            assigned=[], stopped=False, desired="running", desired_tier=None), K.PARKED_DISK,
       "parked to disk: checkpoint of 1.0 GiB at step 3 written in 1.00 s; requeued", (Sample("disk_write_bps", GiB, 1.0),))]),
    ("spill overtaken by a resume", job(**RESUMING_RAM),
     Facts(seen({"state": "checkpointed", "bytes": GiB, "step": 3, "pause_s": 1.0}, exit={"code": REQUEUE_EXIT_CODE})),
     RULES,
     [(dict(state=PD, parked="disk", parked_bytes=GiB, home_gpus=[], step=3, mechanism="cooperative",
            assigned=[], stopped=False, desired="running", desired_tier=None), K.PARKED_DISK,
       "parked to disk: checkpoint of 1.0 GiB at step 3 written in 1.00 s; requeued", (Sample("disk_write_bps", GiB, 1.0),))]),
    ("checkpointed but cancelled", job(**PAUSING, cancel_requested=True),
     Facts(seen({"state": "checkpointed"}, exit={"code": REQUEUE_EXIT_CODE})), RULES,
     [(dict(end_time=T, state=JobState.CANCELLED, exit_code=REQUEUE_EXIT_CODE, signal=None, **ENDED), K.CANCELLED,
       "exited with code 75 after a cancel request", (RemoveCheckpoints(7),))]),
    ("restore failed", job(**RESUMING_DISK), Facts(seen({"restore_failed": "no usable checkpoint"},
                                                        exit={"code": 1})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=1, signal=None, **ENDED), K.FAILED,
       "no usable checkpoint (exited with code 1)", ())]),
    ("resumed, trained and exited between two ticks", job(**RESUMING_DISK),
     Facts(seen({"attached": True, "restored_step": 8, "restored_bytes": GiB, "restore_s": 0.5},
                exit={"code": 0, "time": T - 2})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, last_start=T - 2), K.RESTARTED_DISK,
       "restarted from its disk checkpoint at step 8 (1.0 GiB read in 0.50 s)", (Sample("disk_read_bps", GiB, 0.5),)),
      (dict(end_time=T - 2, state=JobState.COMPLETED, exit_code=0, signal=None, **ENDED), K.COMPLETED,
       "exited with code 0", (RemoveCheckpoints(7),))]),
    ("exit while resuming, nothing restored", job(**RESUMING_DISK), Facts(seen({}, exit={"code": 1})), RULES,
     [(dict(end_time=T, state=JobState.FAILED, exit_code=1, signal=None, **ENDED), K.FAILED,
       "exited with code 1 while resuming", ())]),
    ("parked in RAM", job(**PAUSING), Facts(seen({"state": "paused", "tier": "ram", "bytes": 3 * GiB, "step": 5,
                                                  "pause_s": 0.25}), residue={0: 512 << 20}), RULES,
     [(dict(step=5), None, None, ()),
      (dict(state=PD, parked="ram", parked_bytes=3 * GiB, home_gpus=[0], assigned=[], step=5, residue={0: 512 << 20}),
       K.PARKED_RAM, "parked in RAM: 3.0 GiB freed from the GPU in 0.25 s; 512.0 MiB stays on GPU 0 (CUDA context and "
                     "memory not attached)", (Sample("ram_park_bps", 3 * GiB, 0.25),))]),
    ("multi-rank parked in RAM", job(**PAUSING, width=2, step=5),
     Facts(seen({"state": "paused", "tier": "ram", "bytes": GiB, "step": 5, "world_size": 2,
                 "group_teardown_s": 0.75})), RULES,
     [(dict(state=PD, parked="ram", parked_bytes=GiB, home_gpus=[0], assigned=[], step=5, residue={}),
       K.PARKED_RAM, "parked in RAM: 1.0 GiB freed from the GPU in 0.00 s", (Sample("group_teardown_s", None, 0.75),))]),
    ("park failed", job(**PAUSING), Facts(seen({"error": "out of host memory", "error_at": T - 1})), RULES,
     [(dict(state=R, desired="running", desired_tier=None, hold=False), K.PARK_FAILED,
       "park failed, job keeps running: out of host memory", ())]),
    ("an error older than the request", job(**PAUSING), Facts(seen({"error": "old", "error_at": T - 50, "attached": True})), RULES, []),
    ("multi-rank park under way", job(**PAUSING, width=2),
     Facts(seen({"world_size": 2, "phase": "tearing down", "attached": True})), RULES, []),
    ("pausing, within the timeout", job(**PAUSING), Facts(seen({"attached": True})), RULES, []),
    ("no safepoint in time: left running", job(**dict(PAUSING, pause_requested_at=T - 31)),
     Facts(seen({"attached": True})), RULES,
     [(dict(state=R, no_runtime=True, hold=False, desired="running", desired_tier=None), K.CANNOT_PARK,
       "cannot park (no safepoint reached within 30 s): left running; it will not be preempted", ())]),
    ("no safepoint in time, but the request never reached the supervisor (a full disk): no timeout",
     job(**dict(PAUSING, pause_requested_at=T - 31)), Facts(seen({"attached": True}, delivered=None)), RULES, []),
    ("the request reached the supervisor late: its timeout runs from then",
     job(**dict(PAUSING, pause_requested_at=T - 31)), Facts(seen({"attached": True}, delivered=T - 5)), RULES, []),
    ("never attached: left running", job(**PAUSING, attached=False, last_start=T - 31), Facts(seen({})), RULES,
     [(dict(state=R, no_runtime=True, hold=False, desired="running", desired_tier=None), K.CANNOT_PARK,
       "cannot park (no gpuswap runtime attached): left running; it will not be preempted", ())]),
    ("not attached yet, within a longer grace", job(**PAUSING, attached=False, last_start=T - 31), Facts(seen({})),
     SLOW_START, []),
    ("never attached within a longer grace", job(**PAUSING, attached=False, last_start=T - 121), Facts(seen({})),
     SLOW_START,
     [(dict(state=R, no_runtime=True, hold=False, desired="running", desired_tier=None), K.CANNOT_PARK,
       "cannot park (no gpuswap runtime attached): left running; it will not be preempted", ())]),
    ("multi-rank, not pausable", job(**dict(PAUSING, pause_requested_at=T - 31), width=2),
     Facts(seen({"attached": True, "world_size": 2, "not_pausable": "1 of 2 ranks attached"})), SIGSTOP,
     [(dict(state=R, no_runtime=True, hold=False, desired="running", desired_tier=None), K.CANNOT_PARK,
       "cannot park (1 of 2 ranks attached): left running; it will not be preempted", ())]),
    ("no safepoint, sigstop fallback asked", job(**dict(PAUSING, pause_requested_at=T - 31)),
     Facts(seen({"attached": True})), SIGSTOP,
     [(dict(stopped=True, no_runtime=True, desired="running", reason="no safepoint reached within 30 s"),
       None, None, ())]),
    ("sigstop not confirmed yet", job(**PAUSING, stopped=True), Facts(seen({"attached": True})), SIGSTOP, []),
    ("sigstop confirmed", job(**PAUSING, stopped=True, reason="no gpuswap runtime attached"),
     Facts(seen({}, stopped=True)), SIGSTOP,
     [(dict(state=PD, parked=None, desired="running"), K.SIGSTOPPED,
       "cannot park (no gpuswap runtime attached): stopped with SIGSTOP; its GPU memory stays allocated and is not "
       "counted as freed", ())]),
    ("spill failed", job(**PARKED_RAM, desired_tier="disk", pause_requested_at=T - 5),
     Facts(seen({"error": "disk full", "error_at": T - 1})), RULES,
     [(dict(desired_tier="ram"), K.SPILL_FAILED, "spill to disk failed, job stays parked in RAM: disk full", ())]),
    ("a user's spill failed: answered, the hold stays, in RAM",
     job(**PARKED_RAM, desired_tier="disk", pause_requested_at=T - 5, hold=True, hold_tier="disk"),
     Facts(seen({"error": "disk full", "error_at": T - 1})), RULES,
     [(dict(desired_tier="ram", hold_tier="ram"), K.SPILL_FAILED,
       "spill to disk failed, job stays parked in RAM: disk full", ())]),
    ("resumed from RAM", job(**RESUMING_RAM), Facts(seen({"state": "running", "resume_s": 0.5})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, home_gpus=[], last_start=T), K.RESUMED_RAM,
       "resumed from RAM in 0.50 s", (Sample("ram_resume_bps", 4 * GiB, 0.5),))]),
    ("multi-rank resumed from RAM", job(**RESUMING_RAM, width=2),
     Facts(seen({"state": "running", "world_size": 2, "group_rebuild_s": 1.25})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, home_gpus=[], last_start=T), K.RESUMED_RAM,
       "resumed from RAM in 0.00 s", (Sample("group_rebuild_s", None, 1.25),))]),
    ("resuming from RAM, not yet", job(**RESUMING_RAM), Facts(seen({"state": "paused", "tier": "ram"})), RULES, []),
    ("restarted from disk", job(**RESUMING_DISK),
     Facts(seen({"attached": True, "restored_step": 40, "restored_bytes": 2 * GiB, "restore_s": 2.0})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, last_start=T), K.RESTARTED_DISK,
       "restarted from its disk checkpoint at step 40 (2.0 GiB read in 2.00 s)", (Sample("disk_read_bps", 2 * GiB, 2.0),))]),
    ("restarted from step 0", job(**RESUMING_DISK), Facts(seen({"attached": True})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, last_start=T), K.RESTARTED_DISK,
       "restarted from step 0: its disk checkpoint was gone", (Sample("disk_read_bps", 0, None),))]),
    ("restarted on request after bad checkpoints", job(**RESUMING_DISK),
     Facts(seen({"attached": True, "restore_note": "every checkpoint was bad; started over"})), RULES,
     [(dict(state=R, parked=None, parked_bytes=0, last_start=T), K.RESTARTED_DISK,
       "every checkpoint was bad; started over", (Sample("disk_read_bps", 0, None),))]),
    ("restarting from disk, not attached yet", job(**RESUMING_DISK), Facts(seen({})), RULES, []),
]


def expected(row: tuple) -> list[tuple]:
    return [(changes, kind, text, effects) for changes, kind, text, effects in row]


@pytest.mark.parametrize("name,record,facts,rules,want", ROWS, ids=[r[0] for r in ROWS])
def test_each_rule(name, record, facts, rules, want):
    verdict = decide(record, facts, T, rules)
    got = [(dict(t.changes), t.event.kind if t.event else None, t.event.text if t.event else None, t.effects)
           for t in verdict.transitions]
    assert got == expected(want)
    assert verdict.driver is None
    state = record.state
    assert lifecycle.violations(record) == []   # a record the daemon could have written ...
    for t in verdict.transitions:          # every state change is an edge of the lifecycle table
        lifecycle.check(state, t.event.kind if t.event else None, t.changes.get("state"))
        state = t.changes.get("state", state)
        record = _after(record, t)
        assert lifecycle.violations(record) == []   # ... and what each transition leaves carries what its state does
    if len(want) == 2 and want[0][1] is K.RESTARTED_DISK:
        assert verdict.transitions[0].at == T - 2      # recorded at the exit time, before the exit


@pytest.mark.parametrize("state,driver", [(PG, "freezing"), (RS, "thawing")])
def test_a_transparent_job_goes_on_to_the_freezer(state, driver):
    record = job(state=state, mechanism="transparent", stopped=False, step=3)
    verdict = decide(record, Facts(seen({"step": 4})), T, RULES)
    assert verdict == Verdict((dataclasses.replace(verdict.transitions[0], changes={"step": 4}),), driver)
    assert not wants_residue(record, seen({"state": "paused", "tier": "ram"}))


def test_what_the_controller_reads_for_a_decision():
    assert not reads_status(job(state=P)) and not reads_status(job(**PARKED_DISK)) and not reads_status(job(generation=0))
    assert reads_status(job()) and reads_status(job(**PARKED_RAM))
    assert wants_residue(job(**PAUSING), seen({"state": "paused", "tier": "ram"}))
    assert not wants_residue(job(**PAUSING), seen({"state": "paused", "tier": "ram"}, exit={"code": 0}))
    assert not wants_residue(job(**PAUSING, stopped=True), seen({"state": "paused", "tier": "ram"}))


def test_every_kind_the_observer_records_has_a_row():
    decided = {kind for *_, want in ROWS for _, kind, _, _ in want if kind is not None}
    assert decided == {K.CANCELLED, K.FAILED, K.COMPLETED, K.PARKED_DISK, K.SPILLED, K.RESTARTED_DISK, K.PARKED_RAM,
                       K.PARK_FAILED, K.CANNOT_PARK, K.SIGSTOPPED, K.SPILL_FAILED, K.RESUMED_RAM}


@pytest.mark.parametrize("record", [job(node="n"), job(node="n", **PAUSING), job(node="n", **PARKED_RAM),
                                    job(node="n", **PARKED_DISK, step=40), job(node="n", **RESUMING_DISK),
                                    job(node="n", state=PD, stopped=True)],
                         ids=["running", "pausing", "parked-ram", "parked-disk", "resuming-disk", "sigstopped"])
def test_a_job_on_a_lost_node_ends_failed_with_its_exit_unknown(record):
    from gpuswap.node.observe import node_lost
    t = node_lost(record, "node n is lost", T)
    assert t.event is not None and t.event.kind is K.FAILED and t.effects == ()   # its checkpoints are kept
    assert t.event.text.startswith("node n is lost; how the job ended there is not known")
    assert ("disk checkpoint (step 40) stays on that node" in t.event.text) == (record.step == 40)
    lifecycle.check(record.state, t.event.kind, t.changes["state"])
    after = _after(record, t)
    assert after.state is JobState.FAILED and (after.exit_code, after.signal) == (None, None)
    assert after.end_time == T and lifecycle.violations(after) == []


RANKS = [{"rank": r, "pid": 500 + r, "state": "running", "connected": True, "device_bytes": GiB} for r in (0, 1)]


@pytest.mark.parametrize("record", [job(node="n", gpus=2, assigned=[0, 1], width=2, ranks=RANKS),
                                    job(node="n", gpus=2, width=2, ranks=RANKS, **dict(PARKED_RAM, home_gpus=[0, 1])),
                                    job(node="n", gpus=2, width=2, ranks=RANKS, **dict(RESUMING_DISK, assigned=[0, 1]))],
                         ids=["running", "parked-ram", "resuming-disk"])
def test_a_multi_rank_job_of_a_lost_node_is_requeued_to_its_checkpoint_with_every_rank_written(record):
    from gpuswap.node.observe import node_lost_requeued
    t = node_lost_requeued(record, "node n is lost", 6, 3 * GiB, T)
    assert t.event is not None and t.event.kind is K.REQUEUED and t.effects == ()
    assert t.event.text == ("node n is lost; requeued from its last disk checkpoint (step 6, 3.0 GiB, 2 parts, "
                            "one per rank), on storage other nodes reach")
    lifecycle.check(record.state, t.event.kind, t.changes["state"])
    after = _after(record, t)
    assert (after.state, after.parked, after.parked_bytes, after.step, after.assigned) == (PD, "disk", 3 * GiB, 6, [])
    assert after.ranks == [dict(r, state="written", connected=False, device_bytes=0) for r in RANKS]
    assert after.width == 2 and lifecycle.violations(after) == []
