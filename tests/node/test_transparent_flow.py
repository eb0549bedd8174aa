"""The transparent path's control flow against an explicit fake of the CUDA driver's checkpoint API
(order of calls, timeouts, failures, refusals), with a real SQLite store and real processes.
The fake stands in for the absent GPU driver only; everything else is the production code."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

from gpuswap.jobs import JobState
from gpuswap.lifecycle import EventKind, NewEvent
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.cuda_ckpt import Capability, CheckpointDriver, CheckpointError
from gpuswap.node.freezer import Freezer, job_parkability, mechanism_for, tiers_for
from gpuswap.policy.capability import NCCL_TRANSPARENT_REFUSAL
from gpuswap.node.gpus import GpuInfo, GpuInventory, GpuProcess
from gpuswap.node.launcher import Observation
from gpuswap.node.store import NewJob, Store
from gpuswap.node.transition import Applier

RESUME = NewEvent(EventKind.RESUME_STARTED, "thawing on GPU 0")


class FakeDriver(CheckpointDriver):
    """The driver's state machine, with call log and injectable failures."""

    def __init__(self, migration: bool = True):
        self.capability = Capability(True, "FAKE driver for tests", migration=migration)
        self.states: dict[int, str] = {}
        self.calls: list[tuple] = []
        self.fail: dict[str, str] = {}

    def _do(self, call: str, pid: int, expect: str, new: str, *extra) -> None:
        self.calls.append((call, pid, *extra))
        if call in self.fail:
            raise CheckpointError(call, self.fail[call])
        if self.states.get(pid, "running") != expect:
            raise CheckpointError(call, "CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = new

    def state(self, pid: int) -> str:
        if "state" in self.fail:
            raise CheckpointError("cuCheckpointProcessGetState", self.fail["state"])
        return self.states.get(pid, "running")

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._do("lock", pid, "running", "locked", timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._do("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        self._do("restore", pid, "checkpointed", "locked", gpu_map)

    def unlock(self, pid: int) -> None:
        self._do("unlock", pid, "locked", "running")


class FakeGpus(GpuInventory):
    """Two 80 GiB 'real' GPUs as NVML would list them (processes and other memory in use settable).
    Like NVML, it does not list a process the driver has checkpointed, nor count its memory."""

    simulated = False

    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.procs: dict[int, tuple[GpuProcess, ...]] = {0: (), 1: ()}
        self.used = {0: 0, 1: 0}

    def list(self) -> list[GpuInfo]:
        out = []
        for i in (0, 1):
            procs = tuple(p for p in self.procs[i] if self.driver.state(p.pid) != "checkpointed")
            out.append(GpuInfo(i, "fake H100", f"GPU-0000000{i}-0000-0000-0000-000000000000", 80 * 2**30,
                               self.used[i] + sum(p.used_bytes or 0 for p in procs), False, procs))
        return out

    def describe(self) -> str:
        return "fake GPUs for tests"


@pytest.fixture
def world(tmp_path: Path):
    proc = subprocess.Popen(["sleep", "600"])
    store = Store(tmp_path / "state.db")
    [job_id] = store.add_jobs([NewJob("t", "u", 0, 0, ["sleep"], "/", {}, 0, 1, 4 * 2**30,
                                      pause_mode="transparent")], time.time())
    store.update(job_id, time.time(), state=JobState.RUNNING, assigned=[0], generation=1,
                 event=NewEvent(EventKind.STARTED, "started on GPU 0"))
    store.update(job_id, time.time(), state=JobState.PAUSING, mechanism="transparent", desired_tier="ram",
                 pause_requested_at=time.time(), event=NewEvent(EventKind.PARK_STARTED, "freezing through the driver"))
    driver = FakeDriver()
    gpus = FakeGpus(driver)
    gpus.procs[0] = (GpuProcess(proc.pid, 3 * 2**30),)     # it declared 4 GiB; NVML measures 3
    freezer = Applied(store, Freezer(driver, gpus, run_dirs(tmp_path)))
    yield store, job_id, proc.pid, gpus, driver, freezer
    proc.kill()
    proc.wait()


class Applied:
    """The freezer as the controller runs it: each step's transition is written to the store."""

    def __init__(self, store: Store, freezer: Freezer) -> None:
        self.store, self.freezer = store, freezer
        self.applier = Applier(store, Bandwidths(), lambda job_id: Path("/nonexistent"))
        self.runner, self.run_dir = freezer.runner, freezer.run_dir

    def _apply(self, job, t) -> None:
        if t is not None:
            self.applier.apply(job.id, t)

    def freezing(self, job, obs, now) -> None:
        self._apply(job, self.freezer.freezing(job, obs, now))

    def thawing(self, job, obs, now) -> None:
        self._apply(job, self.freezer.thawing(job, obs, now))

    def undoing(self, job, obs, now) -> None:
        self._apply(job, self.freezer.undoing(job, obs, now))


def run_dirs(tmp_path: Path):
    def run_dir(job_id: int, generation: int) -> Path:
        d = tmp_path / f"run-{job_id}-{generation}"
        d.mkdir(exist_ok=True)
        return d
    return run_dir


def drive(store, job_id, freezer, pid, method: str, stopped: bool, until, limit: int = 50):
    """Run the freezer like the control loop does; the supervisor's SIGSTOP/SIGCONT follows job.stopped."""
    for _ in range(limit):
        job = store.get(job_id)
        if until(job):
            return job
        stopped = job.stopped
        getattr(freezer, method)(job, Observation({"job_pid": pid, "stopped": stopped}, True, 0.0), time.time())
        while freezer.runner.busy(job_id):
            time.sleep(0.005)
    raise AssertionError(f"no progress: {store.get(job_id)}")


def events(store, job_id):
    return [e.reason for e in store.events(job_id)]


def test_freeze_then_thaw_in_order(world):
    store, job_id, pid, gpus, driver, freezer = world
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint"]
    assert job.parked == "ram" and job.stopped and job.assigned == []
    assert job.parked_bytes == 3 * 2**30              # measured at lock time, not the declared 4 GiB
    assert gpus.list()[0].processes == () and gpus.list()[0].mem_used == 0     # NVML: gone after checkpoint
    assert "frozen transparently" in events(store, job_id)[-1] and "checkpoint" in events(store, job_id)[-1]
    store.update(job_id, time.time(), state=JobState.RESUMING, assigned=[0], event=RESUME)
    order = []
    real_restore = driver.restore
    driver.restore = lambda p, m=None: (order.append(("stopped", store.get(job_id).stopped)), real_restore(p, m))
    job = drive(store, job_id, freezer, pid, "thawing", True, lambda j: j.state == JobState.RUNNING)
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint", "restore", "unlock"]
    assert order == [("stopped", False)]                  # SIGCONT came before the restore
    assert driver.calls[2][2] is None                      # same GPU: no remapping
    assert job.parked is None and "thawed" in events(store, job_id)[-1]


def test_lock_timeout_leaves_job_running_and_refused(world):
    store, job_id, pid, gpus, driver, freezer = world
    driver.fail["lock"] = "CUDA_ERROR_NOT_READY"      # lock's documented timeout return
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
    assert job.transparent_refused == "lock timed out after 10 s" and not job.stopped
    assert "cannot freeze transparently (lock timed out" in events(store, job_id)[-1]
    assert [c[0] for c in driver.calls] == ["lock"]


def test_checkpoint_failure_unlocks_and_keeps_running(world):
    store, job_id, pid, gpus, driver, freezer = world
    driver.fail["checkpoint"] = "CUDA_ERROR_NOT_SUPPORTED"
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
    assert "CUDA_ERROR_NOT_SUPPORTED" in job.transparent_refused
    assert driver.state(pid) == "locked"            # put back by the running job's reconcile (undoing)
    drive(store, job_id, freezer, pid, "undoing", False, lambda j: j.reason.startswith("put back"))
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint", "unlock"]
    assert "put back after a freeze given up on" in events(store, job_id)[-1]
    assert "unlocked CUDA process" in events(store, job_id)[-1]
    assert store.get(job_id).transparent_refused == job.transparent_refused     # a driver refusal stays


def test_a_freeze_given_up_on_is_put_back_by_a_fresh_freezer_once_continued(world):
    """Checkpointed, then its user stops it: refused. The freezer that refused it is gone (a daemon
    restart); a fresh one, keyed on the record kept beside the job, asks nothing while the process
    is stopped, then restores and unlocks it once continued, once, saying so, and lifts the
    refusal (it was the stop alone): the job can be frozen again."""
    import os
    import signal

    from gpuswap.node.freezer import Freezer
    store, job_id, pid, gpus, driver, freezer = world
    real_checkpoint = driver.checkpoint

    def checkpoint_then_stopped(p):
        real_checkpoint(p)
        _stopped_by_its_user(p)
    driver.checkpoint = checkpoint_then_stopped
    try:
        job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
        assert "is stopped by a signal" in job.transparent_refused and driver.state(pid) == "checkpointed"
        assert events(store, job_id)[-1].endswith("frozen transparently again only once it is continued")
        fresh = Applied(store, Freezer(driver, gpus, freezer.run_dir))
        asked = len(driver.calls)
        for _ in range(3):
            fresh.undoing(store.get(job_id), Observation({"job_pid": pid, "stopped": False}, True, 0.0), time.time())
        assert len(driver.calls) == asked and driver.state(pid) == "checkpointed"   # nothing asked while stopped
    finally:
        os.kill(pid, signal.SIGCONT)
        driver.checkpoint = real_checkpoint
    job = drive(store, job_id, fresh, pid, "undoing", False,
                lambda j: driver.state(pid) == "running" and j.transparent_refused is None)
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint", "restore", "unlock"]
    put_back = [e for e in events(store, job_id) if e.startswith("put back")]
    assert len(put_back) == 1 and "restored and unlocked CUDA process" in put_back[0], put_back
    assert put_back[0].endswith("it can be frozen transparently again")
    fresh.undoing(job, Observation({"job_pid": pid, "stopped": False}, True, 0.0), time.time())
    assert len([e for e in events(store, job_id) if e.startswith("put back")]) == 1      # once per need
    store.update(job_id, time.time(), state=JobState.PAUSING, mechanism="transparent", desired_tier="ram",
                 event=NewEvent(EventKind.PARK_STARTED, "freezing through the driver"))
    job = drive(store, job_id, fresh, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    assert job.parked == "ram"


def _stopped_by_its_user(pid: int) -> None:
    """SIGSTOP `pid` and return once the kernel shows it stopped (state T)."""
    import os
    import signal

    os.kill(pid, signal.SIGSTOP)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.005)


def _refused_while_stopped(store, job_id, pid, driver, freezer) -> None:
    """Locked by the freeze, then stopped by its user: refused; continued again at the end."""
    import os
    import signal

    real_lock = driver.lock

    def lock_then_stopped(p, timeout_ms):
        real_lock(p, timeout_ms)
        _stopped_by_its_user(p)
    driver.lock = lock_then_stopped
    try:
        job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
        assert "is stopped by a signal" in job.transparent_refused and driver.state(pid) == "locked"
    finally:
        os.kill(pid, signal.SIGCONT)
        driver.lock = real_lock


def _undo_tick(store, job_id, freezer, pid) -> None:
    freezer.undoing(store.get(job_id), Observation({"job_pid": pid, "stopped": False}, True, 0.0), time.time())
    while freezer.runner.busy(job_id):
        time.sleep(0.005)


def test_an_unknown_error_about_a_given_up_freeze_is_asked_again_not_taken_for_nothing_held(world):
    """Only NOT_INITIALIZED / OPERATING_SYSTEM (measured: a pid without CUDA state) mean the driver
    holds nothing. Any other error of the state question says nothing: taken as "nothing held", the
    record went and the locked process stayed locked for good. Now it is said once, asked again
    each tick, and the process is unlocked once the driver answers."""
    store, job_id, pid, gpus, driver, freezer = world
    _refused_while_stopped(store, job_id, pid, driver, freezer)
    driver.fail["state"] = "CUDA_ERROR_UNKNOWN"
    for _ in range(3):
        _undo_tick(store, job_id, freezer, pid)
    waiting = [e for e in events(store, job_id) if e.startswith("waiting to put back")]
    assert len(waiting) == 1 and "CUDA_ERROR_UNKNOWN" in waiting[0], events(store, job_id)
    assert driver.states[pid] == "locked"
    assert not any(e.startswith("put back") or e.startswith("after a freeze") for e in events(store, job_id))
    del driver.fail["state"]
    job = drive(store, job_id, freezer, pid, "undoing", False, lambda j: j.transparent_refused is None)
    assert driver.state(pid) == "running" and job.state == JobState.RUNNING
    put_back = [e for e in events(store, job_id) if e.startswith("put back")]
    assert len(put_back) == 1 and "unlocked CUDA process" in put_back[0], put_back


@pytest.mark.parametrize("code", ["CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_OPERATING_SYSTEM"])
def test_a_given_up_freeze_of_a_process_without_cuda_state_holds_nothing(world, code):
    store, job_id, pid, gpus, driver, freezer = world
    _refused_while_stopped(store, job_id, pid, driver, freezer)
    driver.states[pid] = "running"          # it left CUDA meanwhile: the driver knows nothing of it
    driver.fail["state"] = code
    job = drive(store, job_id, freezer, pid, "undoing", False, lambda j: j.transparent_refused is None)
    [said] = [e for e in events(store, job_id) if e.startswith("after a freeze given up on")]
    assert said.endswith("the driver held nothing of it; it can be frozen transparently again"), said
    assert not freezer.freezer._path(job).exists()


def test_a_put_back_whose_event_was_not_stored_is_recorded_on_the_next_tick(world, monkeypatch):
    """The freeze's record beside the job goes only after the put-back's event is stored (an
    effect of the transition): a store that fails leaves it, and the next tick records the event
    and lifts the refusal. Before, the record went first and the refusal stayed for good."""
    import sqlite3

    store, job_id, pid, gpus, driver, freezer = world
    _refused_while_stopped(store, job_id, pid, driver, freezer)
    real_update, failed = store.update, []

    def update(jid, at, event=None, **changes):
        if event is not None and event.kind == EventKind.PUT_BACK and not failed:
            failed.append(event)
            raise sqlite3.OperationalError("disk I/O error")
        return real_update(jid, at, event=event, **changes)
    monkeypatch.setattr(store, "update", update)
    with pytest.raises(sqlite3.OperationalError):
        drive(store, job_id, freezer, pid, "undoing", False, lambda j: False)
    assert failed and driver.state(pid) == "running"
    assert freezer.freezer._path(store.get(job_id)).exists()        # the record stays
    job = drive(store, job_id, freezer, pid, "undoing", False, lambda j: j.transparent_refused is None)
    assert len([e for e in events(store, job_id) if e.startswith(("put back", "after a freeze"))]) == 1
    assert not freezer.freezer._path(job).exists()


def test_several_cuda_processes_are_refused_without_touching_the_driver(world):
    """The launched command is a shell; its child and grandchild hold CUDA state (as a torchrun
    job's ranks would): NVML lists two processes, so the freeze is refused before any driver call
    (cuda-checkpoint does not checkpoint the CUDA IPC memory NCCL ranks share)."""
    store, job_id, pid, gpus, driver, freezer = world
    tree = subprocess.Popen(["sh", "-c", "sh -c 'sleep 600' & sleep 600; wait"])
    import psutil
    deadline = time.monotonic() + 180     # both exist (sh forks them when it gets the CPU)
    while len(kids := [p.pid for p in psutil.Process(tree.pid).children(recursive=True) if p.name() == "sleep"]) < 2:
        assert time.monotonic() < deadline, kids
        time.sleep(0.05)
    kids.sort()
    gpus.procs[0] = tuple(GpuProcess(k, 2**30) for k in kids)
    try:
        job = drive(store, job_id, freezer, tree.pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
    finally:
        tree.kill()
        subprocess.run(["pkill", "-P", str(tree.pid)])
        subprocess.run(["kill", "-9", *map(str, kids)], capture_output=True)   # the grandchild too
    assert driver.calls == []
    assert job.transparent_refused == NCCL_TRANSPARENT_REFUSAL and job.parked is None
    assert tiers_for(job, True) == frozenset()          # submitted --pause-mode transparent: nothing else parks it
    assert job_parkability(job, True).why_not == NCCL_TRANSPARENT_REFUSAL


def test_a_multi_rank_runtime_is_refused_without_touching_the_driver(world):
    """A runtime that reported several ranks (world_size > 1): refused before any driver call even
    when NVML shows one process here, and the policy is never offered the driver path for it."""
    store, job_id, pid, gpus, driver, freezer = world
    store.update(job_id, time.time(), width=2)
    assert mechanism_for(store.get(job_id), True) is None          # --pause-mode transparent, 2 ranks
    assert job_parkability(store.get(job_id), True).why_not == NCCL_TRANSPARENT_REFUSAL
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
    assert driver.calls == [] and job.transparent_refused == NCCL_TRANSPARENT_REFUSAL


def test_no_cuda_process_is_refused_without_touching_the_driver(world):
    store, job_id, pid, gpus, driver, freezer = world
    gpus.procs[0] = ()
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.RUNNING)
    assert driver.calls == [] and "no CUDA process found" in job.transparent_refused


def test_thaw_never_asks_the_driver_about_a_stopped_process(world):
    store, job_id, pid, gpus, driver, freezer = world
    drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    store.update(job_id, time.time(), state=JobState.RESUMING, assigned=[0], event=RESUME)
    asked = []
    real_state = driver.state
    driver.state = lambda p: (asked.append(store.get(job_id).stopped), real_state(p))[1]
    drive(store, job_id, freezer, pid, "thawing", True, lambda j: j.state == JobState.RUNNING)
    assert asked and not any(asked)


def test_restart_mid_freeze_continues_from_driver_state(world):
    store, job_id, pid, gpus, driver, freezer = world
    freezer.freezing(store.get(job_id), Observation({"job_pid": pid, "stopped": False}, True, 0.0), time.time())
    while freezer.runner.busy(job_id):              # the lock ran; the daemon dies before its result is read
        time.sleep(0.005)
    assert driver.state(pid) == "locked"
    fresh = Applied(store, Freezer(driver, gpus, freezer.run_dir))
    job = drive(store, job_id, fresh, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint"]
    assert job.parked == "ram" and job.parked_bytes == 3 * 2**30   # the footprint recorded before the lock


def test_no_restore_without_room_then_migrate(world):
    store, job_id, pid, gpus, driver, freezer = world
    drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    gpus.used[1] = 78 * 2**30                       # someone else fills GPU 1
    store.update(job_id, time.time(), state=JobState.RESUMING, assigned=[1], event=RESUME)
    for _ in range(5):
        job = store.get(job_id)
        freezer.thawing(job, Observation({"job_pid": pid, "stopped": job.stopped}, True, 0.0), time.time())
    assert "restore" not in [c[0] for c in driver.calls]
    assert events(store, job_id)[-1].startswith("waiting for room before restoring: GPU 1 has 2.0 GiB free")
    gpus.used[1] = 0
    job = drive(store, job_id, freezer, pid, "thawing", False, lambda j: j.state == JobState.RUNNING)
    restore = next(c for c in driver.calls if c[0] == "restore")
    u0, u1 = (g.uuid for g in gpus.list())
    assert restore[2] == {u0: u1, u1: u0}          # moved GPUs swap; every GPU the driver knows is mapped
    assert "onto GPU 1" in events(store, job_id)[-1]


def test_failed_restore_stops_the_job_rather_than_leaving_it_stuck(world):
    store, job_id, pid, gpus, driver, freezer = world
    drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state == JobState.PAUSED)
    store.update(job_id, time.time(), state=JobState.RESUMING, assigned=[0], event=RESUME)
    driver.fail["restore"] = "CUDA_ERROR_OUT_OF_MEMORY"
    drive(store, job_id, freezer, pid, "thawing", True, lambda j: j.cancel_requested)
    assert "thaw failed" in events(store, job_id)[-1] and "cannot retry" in events(store, job_id)[-1]
    assert [c[0] for c in driver.calls].count("restore") == 1        # never retried


def test_driver_reporting_failed_state_stops_the_job(world):
    store, job_id, pid, gpus, driver, freezer = world
    driver.states[pid] = "failed"
    drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.cancel_requested)
    assert "reports the job's CUDA state as failed" in events(store, job_id)[-1]


def test_migration_map_is_a_permutation_of_every_gpu():
    """The driver wants every GPU mapped, each exactly once (CUDA docs, NVIDIA's migration tests,
    cuda-checkpoint#35); a 2-GPU job moving from 0,1 to 1,2 used to map two GPUs onto GPU 1."""
    from gpuswap.node.transparent import gpu_permutation
    assert gpu_permutation([0, 1], [0], [1]) == {0: 1, 1: 0}
    for home, assigned in (([0, 1], [1, 2]), ([3], [0]), ([0, 2], [2, 0]), ([1], [1])):
        perm = gpu_permutation([0, 1, 2, 3], home, assigned)
        assert sorted(perm) == sorted(perm.values()) == [0, 1, 2, 3], perm
        assert all(perm[h] == a for h, a in zip(home, assigned))


def test_state_queries_never_hold_the_loop_on_a_call_that_does_not_answer():
    """A process stopped between StateQueries' look at /proc and the driver call: the real driver
    answers nothing until it is continued. The loop gets Unanswered, no second call is made for
    that pid meanwhile, and the answer is taken once it comes."""
    import threading

    from gpuswap.node.transparent import StateQueries, Unanswered

    answer, asked = threading.Event(), []

    class Silent:
        def state(self, pid):
            asked.append(pid)
            answer.wait()
            return "running"

    q = StateQueries(Silent(), workers=2, answer_s=0.05)   # type: ignore[arg-type]
    for _ in range(3):
        with pytest.raises(Unanswered, match="no answer about process 4242"):
            q.state(4242)
    assert asked == [4242]                          # one call in flight, not one per tick
    answer.set()
    assert q.state(4242) == "running"
    assert q.state(4242) == "running" and asked == [4242, 4242]


def test_state_queries_wait_once_for_a_process_stopped_with_a_question_in_flight():
    """A process stopped after StateQueries looked at /proc, its question in flight: the first
    ask waits `answer_s`, and each later one (a thaw asks at every tick) said Unanswered only
    after waiting `answer_s` again, holding the control loop that long at every tick while the
    process stayed stopped. Now a later ask about a process that is stopped answers at once."""
    import os
    import signal
    import threading

    from gpuswap.node.transparent import StateQueries, Unanswered

    answer = threading.Event()

    class Silent:
        def state(self, pid):
            answer.wait()
            return "running"

    proc = subprocess.Popen(["sleep", "60"])
    try:
        q = StateQueries(Silent(), workers=2, answer_s=1.0)   # type: ignore[arg-type]
        with pytest.raises(Unanswered, match="no answer"):
            q.state(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(Unanswered, match="stopped"):
                q.state(proc.pid)
            assert time.monotonic() - t0 < 0.5
        os.kill(proc.pid, signal.SIGCONT)
        answer.set()
        assert q.state(proc.pid) == "running"
    finally:
        answer.set()
        proc.kill()
        proc.wait()


def test_one_process_on_two_gpus_is_one_process_to_freeze(world):
    """NVML lists a process once per GPU it uses: the record holds it twice, and counting it twice
    once read as 'a CUDA process of the job exited during the freeze', refusing every such job."""
    store, job_id, pid, gpus, driver, freezer = world
    gpus.procs[1] = (GpuProcess(pid, 2**30),)
    job = drive(store, job_id, freezer, pid, "freezing", False, lambda j: j.state != JobState.PAUSING)
    assert job.state == JobState.PAUSED and job.parked_bytes == 4 * 2**30, events(store, job_id)[-1]
    assert [c[0] for c in driver.calls] == ["lock", "checkpoint"]
