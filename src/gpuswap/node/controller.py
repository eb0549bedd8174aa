"""The daemon's control loop: observe what is, ask the policy what should be, make the moves.

Level-triggered, as a Kubernetes controller: every tick re-reads the database and every live
job's supervisor status, so a daemon restarted at any instant simply converges. Each move is
written to SQLite *before* it is carried out (a launch is idempotent per generation), and the
API never changes a job's state itself: it records the user's intent (cancel, hold and the tier
asked for) and wakes us; `_apply_user_intent` turns it into moves.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from gpuswap import policy
from gpuswap.jobs import JobState, format_size
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node import observe, residue, sessions, snapshot
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.cuda_ckpt import CheckpointDriver
from gpuswap.node.freezer import (ATTACH_GRACE_S, Freezer, awaiting_runtime, deferred_pause_text, job_parkability,
                                  mechanism_for, tiers_for)
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.launcher import Launcher
from gpuswap.node.store import JobRecord, Store
from gpuswap.node.transition import Applier
from gpuswap.node.transparent import job_cuda_processes
from gpuswap.policy.model import Decision, JobView, Pause, PolicyConfig, Resume, Spill, Start, Wait
from gpuswap.policy.classes import class_gpu_s
from gpuswap.protocol.rundir import Desired

log = logging.getLogger("gpuswap.controller")

ACTIVE = (JobState.RUNNING, JobState.PAUSING, JobState.RESUMING)
WITH_PROCESS = ACTIVE + (JobState.PAUSED,)   # PAUSED in RAM or by SIGSTOP keeps its process
MIN_GAP_S = 0.05
HELD = Wait("", "JobHeldUser", "paused by its owner; `gpuswap resume` lets it run again")


@dataclass
class ControllerConfig:
    """The daemon's settings the controller acts on; their defaults and checks are node/settings.py's."""
    policy: str
    pause_timeout_s: float             # no safepoint within this long after a pause request: fall back
    no_runtime: str                    # fallback: "wait" (keep running) or "sigstop" (memory stays on GPU)
    ram_budget: int                    # bytes of host RAM parked jobs may hold
    tick_s: float = 0.2
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)


class Controller:
    def __init__(self, store: Store, launcher: Launcher, gpus: GpuInventory, config: ControllerConfig,
                 driver: CheckpointDriver, bandwidths: Bandwidths, clock: Callable[[], float] = time.time):
        self.store, self.launcher, self.gpus, self.config, self.clock = store, launcher, gpus, config, clock
        self.driver, self.bandwidths = driver, bandwidths
        self.transparent_ok = driver.capability.available
        self.freezer = Freezer(driver, gpus, launcher.run_dir)
        self.rules = observe.Rules(config.pause_timeout_s, config.no_runtime)
        self.applier = Applier(store, bandwidths, launcher.ckpt_dir)
        self.usage = store.load_usage()
        self.class_usage = store.load_class_usage()     # for the class budgets (policy/classes.py)
        self._wake = threading.Event()
        self.changed = threading.Condition()
        self._last_tick: Optional[float] = None
        self._accrued: dict[int, list[float]] = {}
        self._last_flush = 0.0
        self._live: dict[int, JobRecord] = {}
        self._views: dict[int, tuple[int, JobView]] = {}
        self._seen_version = 0
        self._faults: dict[tuple[int, str], str] = {}   # (job id, step) -> the failure last reported
        # Why each waiting job waits, from the policy's last round (replaced whole each tick, so
        # API threads read one consistent dict), and the key of the reason last written as an event.
        self.waits: dict[int, Wait] = {}
        self._told: dict[int, tuple] = {}

    # -- loop -------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        failing: Optional[str] = None
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
                if failing is not None:
                    log.warning("controller ticks succeed again")
                    failing = None
            except Exception as e:   # a bad tick must never kill the daemon; the next one retries
                # Logged once per kind of failure: a full disk fails every tick, 5 times a second.
                if failing != (what := f"{type(e).__name__}: {e}"):
                    log.exception("controller tick failed (logged again only if the failure changes)")
                    failing = what
            # Under a burst of submits, wake-ups would make ticks back to back and starve the
            # API of the interpreter: rest at least as long as the tick took.
            time.sleep(max(MIN_GAP_S, time.monotonic() - started))
            self._wake.wait(self.config.tick_s)
            self._wake.clear()

    def tick(self) -> None:
        now = self.clock()
        for job in list(self._refresh().values()):
            if job.state in WITH_PROCESS or job.cancel_requested:
                self._isolated(job, now, "to observe it", self._observe, job, now)
        for job in list(self._refresh().values()):
            if job.state in WITH_PROCESS:
                self._isolated(job, now, "to apply its user's request", self._apply_user_intent, job, now)
        live = self._refresh()
        jobs = sorted(live.values(), key=lambda j: j.id)
        self._accrue(jobs, now)
        views = [self._view(j) for j in jobs if snapshot.schedulable(j)]
        kept = residue.outside_snapshot(jobs, {int(v.id) for v in views})   # e.g. a user's RAM pause
        snap = snapshot.build(now, self.gpus.list(), views, self.config.policy_config, self.bandwidths.costs(),
                              self.config.ram_budget, self.usage, kept, self.class_usage)
        decisions, waits = policy.decide_explained(snap, self.config.policy)
        for d in decisions:
            job = live.get(int(d.job_id))
            if job is not None:
                self._isolated(job, now, f"to carry out a {type(d).__name__.lower()}", self._apply, d, job, now)
        try:
            self._explain(live, waits, now)
        except Exception:   # a reason that cannot be recorded (a full disk) must not stop the moves below
            log.exception("could not record why jobs wait")
        for job in list(self._refresh().values()):
            if job.state in WITH_PROCESS:
                self._isolated(job, now, "to update what its supervisor is asked", self._push_desired, job)
        self.launcher.reap()
        with self.changed:
            self.changed.notify_all()

    def _isolated(self, job: JobRecord, now: float, doing: str, step: Callable[..., None], *args: object) -> None:
        """Run one job's step so that its failure costs that job only, never the tick: every
        other job is still observed and scheduled. Reported once per job and step (log and the
        job's events) until that step succeeds again, not on every tick it repeats."""
        key = (job.id, doing)
        try:
            step(*args)
        except Exception as e:
            what = f"{type(e).__name__}: {str(e)[:200]}"
            if self._faults.get(key) == what:
                return
            self._faults[key] = what
            log.exception("job %d: gpuswap failed %s", job.id, doing)
            try:
                self.store.update(job.id, now, event=NewEvent(
                    K.STEP_FAILED, f"gpuswap failed {doing} ({what}); it retries on every tick, and other jobs "
                                   "are unaffected"))
            except Exception:
                log.exception("job %d: could not record that failure", job.id)
        else:
            if self._faults:
                self._faults.pop(key, None)

    def _observe(self, job: JobRecord, now: float) -> None:
        """Read what is (the supervisor's status, and what NVML or /proc must add), let
        node/observe.py decide what that changes, and apply it; then the freezer's driver steps."""
        obs = self.launcher.observe(job.id, job.generation) if observe.reads_status(job) else None
        pid = obs.job_pid if obs is not None else None
        facts = observe.Facts(obs)
        if obs is not None and observe.wants_residue(job, obs):
            facts = observe.Facts(obs, residue=residue.measure(obs.job_pid, self.gpus, job.assigned))
        elif obs is not None and obs.exit is None and not obs.alive and pid is not None and pid > 1:
            # Its supervisor is gone: what is left of the job's processes (killed if any, observe.py).
            facts = observe.Facts(obs, orphans=sessions.alive(pid, obs.job_start_ticks, obs.rank_pids))
        verdict = observe.decide(job, facts, now, self.rules)
        for t in verdict.transitions:
            self.applier.apply(job.id, t)
        if verdict.driver is not None and obs is not None:
            step = getattr(self.freezer, verdict.driver)(job, obs, now)
            if step is not None:
                self.applier.apply(job.id, step)

    def wait_of(self, job: JobRecord) -> Optional[Wait]:
        """Why this job waits (a PENDING or PAUSED job the last round did not start), or None."""
        if job.state not in (JobState.PENDING, JobState.PAUSED) or job.cancel_requested:
            return None
        if job.hold and not job.holds_gpu:
            return HELD
        return self.waits.get(job.id)

    def _explain(self, live: dict[int, JobRecord], waits: dict[str, Wait], now: float) -> None:
        """Keep the policy's reasons, and write one as an event when a job's reason changes in
        substance (its rule or who holds it, not a countdown), so the log says why it waited."""
        kept = {int(k): w for k, w in waits.items()}
        for jid, w in kept.items():
            job = live.get(jid)
            if job is None or job.state not in (JobState.PENDING, JobState.PAUSED):
                continue
            key = (w.code, tuple((b.job_id, b.code) for b in w.blockers))
            if self._told.get(jid) != key:
                self._told[jid] = key
                self.store.add_event(jid, now, job.state, f"waiting ({w.code}): {w.text}", K.WAITING)
        for jid in [j for j in self._told if j not in kept]:
            del self._told[jid]
        self.waits = kept

    def _refresh(self) -> dict[int, JobRecord]:
        """The live jobs, kept current by reading only rows written since the last read."""
        for rec in self.store.changed_since(self._seen_version):
            self._seen_version = max(self._seen_version, rec.version)
            if rec.state.terminal:
                self._live.pop(rec.id, None)
                self._views.pop(rec.id, None)
            else:
                self._live[rec.id] = rec
        return self._live

    def _view(self, job: JobRecord) -> JobView:
        cached = self._views.get(job.id)
        if cached is None or cached[0] != job.version:
            cached = self._views[job.id] = (job.version, snapshot.job_view(
                job, self.transparent_ok, self.driver.capability.migration))
        return cached[1]

    # -- accounting -------------------------------------------------------------------------
    def _accrue(self, jobs: list[JobRecord], now: float) -> None:
        """Attained service, run and switch time, and fair-share usage; flushed every second."""
        dt = 0.0 if self._last_tick is None else max(0.0, now - self._last_tick)
        self._last_tick = now
        gpu_s_by_user: dict[str, float] = {}
        gpu_s_by_class: dict[tuple[str, int], float] = {}
        for j in jobs:
            if j.state == JobState.RUNNING and not j.stopped:
                acc = self._accrued.setdefault(j.id, [0.0, 0.0, 0.0])
                acc[0] += dt * j.gpus
                acc[1] += dt
                gpu_s_by_user[j.user] = gpu_s_by_user.get(j.user, 0.0) + dt * j.gpus
                key = (j.user, j.priority)
                gpu_s_by_class[key] = gpu_s_by_class.get(key, 0.0) + dt * j.gpus
            elif j.state in (JobState.PAUSING, JobState.RESUMING):
                self._accrued.setdefault(j.id, [0.0, 0.0, 0.0])[2] += dt
        self.usage = policy.decay_usage(
            self.usage, dt, gpu_s_by_user, self.config.policy_config.fair_share_half_life_s)
        self.class_usage = policy.decay_usage(
            self.class_usage, dt, class_gpu_s(gpu_s_by_class), self.config.policy_config.class_half_life_s)
        if now - self._last_flush >= 1.0:
            self.store.accrue([(jid, a, r, s) for jid, (a, r, s) in self._accrued.items() if a or r or s])
            self.store.save_usage(self.usage, now)
            self.store.save_class_usage(self.class_usage, now)
            self._accrued.clear()
            self._last_flush = now

    # -- moves ------------------------------------------------------------------------------
    def _apply_user_intent(self, job: JobRecord, now: float) -> None:
        """A user's `pause` becomes the controller's move, like a policy one: a held running job's
        pause to its `hold_tier`, a held RAM-parked job's spill to disk. The API records only what
        was asked (hold, hold_tier); this turns it into the move on every tick until the move is
        recorded, so a daemon killed between the two still makes it after its restart."""
        if not job.hold or job.cancel_requested:
            return
        if job.state == JobState.RUNNING:
            tier = job.hold_tier or "ram"
            if awaiting_runtime(job, now) and not self._freezable_now(job, tier):
                # Decided on a job still importing its framework, a disk pause would be refused and
                # a RAM one tried on a process with no CUDA state; wait for the attach (or the grace).
                if job.reason != deferred_pause_text(tier):
                    self.store.update(job.id, now, event=NewEvent(K.PAUSE_DEFERRED, deferred_pause_text(tier),
                                                                  tier=tier, initiator="user"))
                return
            if tier not in tiers_for(job, self.transparent_ok):
                self.store.update(job.id, now, hold=False, event=NewEvent(
                    K.PAUSE_REFUSED, f"pause to {tier} refused: this job cannot be parked there "
                                     f"({self._why_not(job)})", tier=tier, initiator="user"))
                return
            self._pause(job, tier, now, "requested by user", by="user")
        elif (job.state == JobState.PAUSED and job.parked == "ram" and job.hold_tier == "disk"
              and job.desired_tier != "disk"):             # not yet asked of its supervisor
            if job.mechanism == "transparent":
                # Its process tree is frozen by the driver: nothing in it can write a checkpoint.
                # The request is answered (hold_tier back to RAM); the job stays held in RAM.
                self.store.update(job.id, now, hold_tier="ram", event=NewEvent(
                    K.PAUSE_REFUSED, "spill to disk refused: a driver-frozen job is held in RAM; CRIU disk dumps "
                                     "are not supported", tier="disk", initiator="user"))
                return
            self._spill(job, now, "requested by user", by="user")

    def _freezable_now(self, job: JobRecord, tier: str) -> bool:
        """A RAM pause of a job not yet attached can be carried out by the driver right away if the
        job already has a CUDA process: frozen whole, it is parked correctly whatever it turns out to be."""
        if tier != "ram" or mechanism_for(job, self.transparent_ok) != "transparent":
            return False
        pid = self.launcher.observe(job.id, job.generation).job_pid
        return bool(pid) and bool(job_cuda_processes(pid, self.gpus))

    def _apply(self, d: Decision, job: JobRecord, now: float) -> None:
        detail = {k: getattr(d, k) for k in d.__dataclass_fields__ if k != "job_id"}
        if isinstance(d, Start) and job.state == JobState.PENDING and not job.cancel_requested:
            gen = job.generation + 1
            self.store.update(job.id, now, state=JobState.RUNNING, assigned=list(d.gpus), generation=gen,
                              last_start=now, desired="running", desired_tier=None, attached=False,
                              event=NewEvent(K.STARTED, _with_reason(f"started on GPU {_gpus(d.gpus)}", d.reason),
                                             initiator="policy"))
            self._launch(job, gen, d.gpus)
        elif isinstance(d, Pause) and job.state == JobState.RUNNING and d.tier in tiers_for(job, self.transparent_ok):
            self._pause(job, d.tier, now, d.reason, by="policy")
        elif isinstance(d, Resume) and job.state == JobState.PAUSED:
            self._resume(job, d, now)
        elif (isinstance(d, Spill) and job.state == JobState.PAUSED and job.parked == "ram"
              and job.desired_tier != "disk"):        # already spilling: the policy repeats itself
            self._spill(job, now, d.reason, by="policy")
        else:
            return
        self.store.record_decision(now, type(d).__name__.lower(), job.id, detail)

    def _pause(self, job: JobRecord, tier: str, now: float, reason: str, by: str) -> None:
        """Start parking `job`; `by` ('policy' or 'user') is recorded on the event, and only the
        policy's pauses count as preemptions."""
        mech = mechanism_for(job, self.transparent_ok)
        what = "freezing through the driver" if mech == "transparent" else f"pausing to {tier}"
        changes: dict = dict(state=JobState.PAUSING, mechanism=mech, desired_tier=tier, pause_requested_at=now,
                             ram_allowance=self._ram_room(job) if tier == "ram" else None)
        if mech == "cooperative":
            changes["desired"] = "paused"
        if by == "policy":
            changes["preemptions"] = job.preemptions + 1
        self.store.update(job.id, now, event=NewEvent(K.PARK_STARTED, _with_reason(what, reason), tier=tier,
                                                      mechanism=mech, initiator=by), **changes)

    def _spill(self, job: JobRecord, now: float, reason: str, by: str) -> None:
        """Ask a RAM-parked job's runtime to move its state to disk (pushed to its supervisor later
        in this tick); the request time bounds which runtime error answers it (observe.py)."""
        self.store.update(job.id, now, desired="paused", desired_tier="disk", pause_requested_at=now,
                          event=NewEvent(K.SPILL_REQUESTED, _with_reason("spilling from RAM to disk", reason),
                                         initiator=by))

    def _ram_room(self, job: JobRecord) -> int:
        """What the host-RAM budget has left for this job's park. The policy chose RAM on estimates;
        this hard cap travels with the request, so a job larger than its estimate is parked to
        disk instead (cooperative) or not frozen (transparent), and the budget is never exceeded."""
        held = sum(j.parked_bytes for j in self._live.values() if j.parked == "ram" and j.id != job.id)
        inflight = sum(j.ram_allowance or 0 for j in self._live.values()
                       if j.state == JobState.PAUSING and j.desired_tier == "ram" and j.id != job.id)
        return max(0, self.config.ram_budget - held - inflight)

    def _why_not(self, job: JobRecord) -> str:
        if job.transparent_refused:
            return job.transparent_refused
        if job.width > 1 or job.ram_refusal:      # the multi-rank rules: capability.py says why
            why = job_parkability(job, self.transparent_ok).why_not
            if why:
                return why
        if job.no_runtime:
            return "it reached no safepoint when last asked to pause; it is not asked again"
        if mechanism_for(job, self.transparent_ok) == "transparent":
            unattached = (f"no gpuswap runtime attached within {ATTACH_GRACE_S:g} s of its start, and "
                          if job.pause_mode == "auto" and not job.attached else "")
            return f"{unattached}a driver-frozen job is held in RAM; CRIU disk dumps are not supported"
        return f"pause mode {job.pause_mode}; {self.driver.capability.reason}"

    def _resume(self, job: JobRecord, d: Resume, now: float) -> None:
        park = job.parked_state
        if park is None and job.stopped:     # the SIGSTOP fallback: nothing was moved
            self.store.update(job.id, now, state=JobState.RUNNING, stopped=False, last_start=now,
                              event=NewEvent(K.CONTINUED, _with_reason("continued (SIGCONT)", d.reason),
                                             initiator="policy"))
        elif park is not None and park.tier == "ram":
            movable = park.mechanism == "transparent"
            pinned = park.home_gpus and not (movable and self.driver.capability.migration)
            if pinned and sorted(d.gpus) != sorted(park.home_gpus):
                return   # its CUDA context lives on its home GPUs; wait for those
            self.store.update(job.id, now, state=JobState.RESUMING, desired="running", desired_tier=None,
                              assigned=list(d.gpus), event=NewEvent(
                                  K.RESUME_STARTED, _with_reason(f"{'thawing' if movable else 'resuming from RAM'} "
                                                                 f"on GPU {_gpus(d.gpus)}", d.reason),
                                  tier="ram", mechanism=park.mechanism, initiator="policy"))
        elif park is not None and park.tier == "disk":
            gen = job.generation + 1
            self.store.update(job.id, now, state=JobState.RESUMING, desired="running", desired_tier=None,
                              assigned=list(d.gpus), generation=gen, attached=False, event=NewEvent(
                                  K.RESUME_STARTED, _with_reason(
                                      f"restarting from its disk checkpoint ({format_size(park.nbytes)}) "
                                      f"on GPU {_gpus(d.gpus)}", d.reason),
                                  tier="disk", mechanism="cooperative", initiator="policy"))
            self._launch(job, gen, d.gpus)

    def _launch(self, job: JobRecord, generation: int, gpus: tuple[int, ...] | list[int]) -> None:
        self.launcher.launch(job, self.store.env(job.id), generation, self.gpus.visible_devices(list(gpus)),
                             Desired(run="running"))

    def _push_desired(self, job: JobRecord) -> None:
        if job.generation == 0 or (job.state == JobState.PAUSED and job.parked == "disk"):
            return
        if job.state in ACTIVE and not self.launcher.spawned(job.id, job.generation):
            # The daemon died between recording a start and spawning it: spawn now (idempotent).
            self._launch(job, job.generation, job.assigned)
        self.launcher.set_desired(job.id, job.generation, Desired(
            run=job.desired, tier=job.desired_tier, sigstop=job.stopped,
            cancel=job.cancel_requested, max_bytes=job.ram_allowance))


def _gpus(gpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(g) for g in gpus)


def _with_reason(what: str, reason: str) -> str:
    """The policy's reason, led by what we did unless the reason already says it."""
    if not reason:
        return what
    if reason.split()[0].lower()[:5] == what.split()[0].lower()[:5]:
        return reason
    return f"{what}: {reason}"
