"""Slurm-style pending reasons: one pure function, pinned case by case."""
from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from gpuswap.api.reasons import REASONS, pending_reason
from gpuswap.jobs import JobState, Priority
from gpuswap.node.store import JobRecord

_DEFAULTS: dict[str, Any] = dict(
    name="j", user="u", uid=1000, gid=1000, argv=["x"], cwd="/", env={}, priority=int(Priority.NORMAL), gpus=1,
    mem_bytes=0, preemptible=True, state=JobState.PENDING, reason="", exit_code=None, signal=None,
    submit_time=0.0, state_since=0.0, last_start=None, end_time=None, attained_gpu_s=0.0, run_s=0.0,
    switch_s=0.0, assigned=[], home_gpus=[], parked=None, parked_bytes=0, device_bytes=0, generation=0,
    desired="running", desired_tier=None, pause_requested_at=None, hold=False, no_runtime=False,
    stopped=False, cancel_requested=False, preemptions=0, step=None)


def job(id: int, **kw: Any) -> JobRecord:
    values = {**_DEFAULTS, "id": id, "submit_time": float(id), **kw}
    # Columns added later default to their declared default, else 0: the builder outlives schema growth.
    return JobRecord(**{f.name: values.get(f.name, 0 if f.default is MISSING else f.default)
                        for f in fields(JobRecord)})


def running(id: int, gpus: list[int], **kw: Any) -> JobRecord:
    return job(id, state=JobState.RUNNING, assigned=gpus, gpus=len(gpus), **kw)


def test_not_waiting_has_no_reason():
    r = running(1, [0])
    assert pending_reason(r, [r], 1) is None
    done = job(2, state=JobState.COMPLETED)
    assert pending_reason(done, [r], 1) is None


def test_held_by_user():
    p = job(1, state=JobState.PAUSED, parked="ram", hold=True, home_gpus=[0])
    assert pending_reason(p, [p], 1) == "JobHeldUser"


def test_resources_when_gpus_busy_and_nobody_ahead():
    r, w = running(1, [0]), job(2)
    assert pending_reason(w, [r, w], 1) == "Resources"


def test_priority_when_a_better_job_waits_for_the_same_gpus():
    r = running(1, [0])
    urgent = job(2, priority=int(Priority.URGENT))
    low = job(3, priority=int(Priority.LOW))
    assert pending_reason(low, [r, urgent, low], 1) == "Priority"
    assert pending_reason(urgent, [r, urgent, low], 1) == "Resources"


def test_preempting_while_a_victim_parks():
    victim = job(1, state=JobState.PAUSING, assigned=[0])
    urgent = job(2, priority=int(Priority.URGENT))
    assert pending_reason(urgent, [victim, urgent], 1) == "Preempting"


def test_fits_now_means_none_yet():
    w = job(1)
    assert pending_reason(w, [w], 2) == "None"


def test_ram_parked_job_waits_for_its_home_gpu():
    other = running(1, [1])
    parked = job(2, state=JobState.PAUSED, parked="ram", home_gpus=[1])
    assert pending_reason(parked, [other, parked], 2) == "Resources"   # GPU 0 is free, but not its home


def test_every_code_is_explained():
    assert {"JobHeldUser", "Priority", "Preempting", "Resources", "None"} <= set(REASONS)
