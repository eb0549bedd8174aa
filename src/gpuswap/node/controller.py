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
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

from gpuswap import policy
from gpuswap.jobs import JobState, format_size
from gpuswap.lifecycle import STARTED, EventKind as K, NewEvent
from gpuswap.node import observe, residue, snapshot
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.nodebandwidths import NodeBandwidths
from gpuswap.node.freezer import (awaiting_runtime, deferred_pause_text, job_parkability,
                                  mechanism_for, tiers_for)
from gpuswap.node.cuda_ckpt import Capability
from gpuswap.node.launcher import Launcher
from gpuswap.node.placement import Placement, on_disk
from gpuswap.node.pool import Node, Pool
from gpuswap.node.strays import StrayCheck
from gpuswap.node.store import JobRecord, Store
from gpuswap.node.transition import Applier
from gpuswap.policy.model import Decision, Pause, PolicyConfig, Resume, Spill, Start, Wait
from gpuswap.policy.classes import class_gpu_s
from gpuswap.protocol.rundir import Desired

log = logging.getLogger("gpuswap.controller")

ACTIVE = (JobState.RUNNING, JobState.PAUSING, JobState.RESUMING)
WITH_PROCESS = ACTIVE + (JobState.PAUSED,)   # PAUSED in RAM or by SIGSTOP keeps its process
MIN_GAP_S = 0.05
# Why each waiting job waits is worked out after the decisions are carried out, with a waiting job
# that has no reason yet at once, and otherwise when the last reasons are EXPLAIN_SHARE times as
# old as they took to work out, or EXPLAIN_S: with a short queue every tick (a millisecond), with
# 1,000 queued jobs (85-230 ms, ten times the decision: bench/bench_pool.py) about once a second
# or two. A reason that old misleads nobody, and the controller's time goes to deciding.
EXPLAIN_S = 2.0
EXPLAIN_SHARE = 10.0
HELD = Wait("", "JobHeldUser", "paused by its owner; `gpuswap resume` lets it run again")


@dataclass
class ControllerConfig:
    """The daemon's settings the controller acts on; their defaults and checks are node/settings.py's."""
    policy: str
    pause_timeout_s: float             # no safepoint within this long after a pause request: fall back
    no_runtime: str                    # fallback: "wait" (keep running) or "sigstop" (memory stays on GPU)
    ram_budget: int                    # bytes of host RAM parked jobs may hold
    attach_grace_s: float              # an auto-mode job without a runtime attached this long has none
    tick_s: float = 0.2
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)


class Controller:
    """`pool`: the machines it schedules over (node/pool.py): this one alone for the classic
    daemon, or a Ray cluster's nodes (docs/ray.md). `launcher`: the daemon's own job directories."""

    def __init__(self, store: Store, launcher: Launcher, pool: Pool, config: ControllerConfig,
                 bandwidths: Bandwidths, clock: Callable[[], float] = time.time,
                 node_bandwidths: Optional[NodeBandwidths] = None):
        self.store, self.launcher, self.pool, self.config, self.clock = store, launcher, pool, config, clock
        self.bandwidths = bandwidths
        self.node_bandwidths = node_bandwidths     # a pool's: each node's own figures (None: one machine)
        self.rules = observe.Rules(config.pause_timeout_s, config.no_runtime, config.attach_grace_s)
        self.applier = Applier(store, bandwidths, launcher.ckpt_dir, node_bandwidths)
        self.placement = Placement(pool)    # where jobs are and may go, in the policy's GPU ids
        pool.notify = self.wake
        self.usage = store.load_usage()
        self.class_usage = store.load_class_usage()     # for the class budgets (policy/classes.py)
        self._wake = threading.Event()
        self.changed = threading.Condition()
        self._last_tick: Optional[float] = None
        self._accrued: dict[int, list[float]] = {}
        self._last_flush = 0.0
        self._live: dict[int, JobRecord] = {}
        self._seen_version = 0
        self._faults: dict[tuple[int, str], str] = {}   # (job id, step) -> the failure last reported
        # Why each waiting job waits, from the policy's last round (replaced whole each tick, so
        # API threads read one consistent dict), and the key of the reason last written as an event.
        self.waits: dict[int, Wait] = {}
        self._told: dict[int, tuple] = {}
        self._explained_at = float("-inf")
        self.strays = StrayCheck(pool, store.get)
        self._explain_took = 0.0

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
        if not self.pool.single:
            self._end_lost(now)
            self.strays.run()       # a node that came back runs nothing the records ended
        # The interval since the last tick is counted by the states the jobs had in it, before
        # observing what ended in it: a job that exited within it ran for it too.
        before = self._refresh()
        self._accrue(sorted(before.values(), key=lambda j: j.id), now)
        for job in list(before.values()):
            if job.state in WITH_PROCESS or job.cancel_requested:
                self._isolated(job, now, "to observe it", self._observe, job, now)
        for job in list(self._refresh().values()):
            if job.state in WITH_PROCESS:
                self._isolated(job, now, "to apply its user's request", self._apply_user_intent, job, now)
        live = self._refresh()
        jobs = sorted(live.values(), key=lambda j: j.id)
        pool_gpus = self.pool.gpus()
        layout = self.placement.relayout(pool_gpus)
        views = self.placement.views([j for j in jobs if snapshot.schedulable(j)])
        seen = {int(v.id) for v in views}
        kept = (residue.outside_snapshot(jobs, seen) if self.pool.single    # e.g. a user's RAM pause
                else snapshot.kept_in_pool(jobs, seen, layout))
        snap = snapshot.build(now, snapshot.pool_gpus(pool_gpus, self.pool.single), views,
                              self.config.policy_config, self.bandwidths.costs(), self.ram_budgets(pool_gpus), self.usage,
                              kept, self.class_usage,
                              None if self.node_bandwidths is None else self.node_bandwidths.costs(pool_gpus))
        decisions = policy.decide(snap, self.config.policy)
        for d in decisions:
            job = live.get(int(d.job_id))
            if job is not None:
                self._isolated(job, now, f"to carry out a {type(d).__name__.lower()}", self._apply, d, job, now)
        # Then, when due, why the others wait: the same snapshot gives the same decisions.
        acted = {int(d.job_id) for d in decisions}
        unexplained = any(j not in self.waits and j not in acted and live[j].state in (JobState.PENDING, JobState.PAUSED)
                          for j in seen)
        since = time.monotonic() - self._explained_at
        if unexplained or since >= min(EXPLAIN_S, EXPLAIN_SHARE * self._explain_took):
            started = time.monotonic()
            try:
                self._explain(live, {**policy.decide_explained(snap, self.config.policy)[1],
                                     **self.placement.nowhere()}, now)
            except Exception:   # a reason that cannot be recorded (a full disk) must not stop the moves below
                log.exception("could not record why jobs wait")
            self._explained_at = time.monotonic()
            self._explain_took = self._explained_at - started
        for job in list(self._refresh().values()):
            if job.state in WITH_PROCESS:
                self._isolated(job, now, "to update what its supervisor is asked", self._push_desired, job)
        self.pool.reap()
        with self.changed:
            self.changed.notify_all()

    def _end_lost(self, now: float) -> None:
        """A pool's jobs on a node lost for good end FAILED (observe.node_lost); their GPUs are gone."""
        jobs = [j for j in self._refresh().values() if j.node is not None and j.state in STARTED]
        lost = self.pool.lost({j.node for j in jobs if j.node is not None})
        for job in jobs:
            if job.node not in lost:
                continue
            reach = self.pool.disk_nodes(job.node)
            if on_disk(job) and reach:
                continue         # its checkpoint is on storage other nodes reach: it resumes there
            self._settle(job.id)
            self._isolated(job, now, "to end it (its node is lost)", self._lose, job, reach, lost[job.node], now)

    def _lose(self, job: JobRecord, reach: tuple[str, ...], why: str, now: float) -> None:
        """Back to its last disk checkpoint where another node reaches one (shared storage), else FAILED."""
        found = self.pool.on(reach[0]).last_checkpoint(job.id, job.width) if reach else None
        self.applier.apply(job.id, observe.node_lost_requeued(job, why, *found, now) if found
                           else observe.node_lost(job, why, now))

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
        node = self._node(job)
        # Its supervisor is read on its node, with what NVML or /proc must add there (pool.node_facts).
        facts = node.observe(job) if node is not None else observe.Facts(None)
        obs = facts.obs
        verdict = observe.decide(job, facts, now, self.rules)
        if any("state" in t.changes for t in verdict.transitions):
            self._settle(job.id)
        for t in verdict.transitions:
            self.applier.apply(job.id, t, None if self.pool.single else node)
        if verdict.driver is not None and obs is not None and node is not None:
            step = node.driver_step(verdict.driver, job, obs, now)
            if step is not None:
                self.applier.apply(job.id, step, None if self.pool.single else node)

    def _settle(self, job_id: int) -> None:
        """Write a job's run and service time accrued so far before its state changes: a job
        reported ended (to `wait`, to the predictor of the next submission) has its final figures."""
        acc = self._accrued.pop(job_id, None)
        if acc is not None and any(acc):
            self.store.accrue([(job_id, *acc)])

    def _node(self, job: JobRecord) -> Optional[Node]:
        """The node a job with a process is on; None for one not placed yet (PENDING, or parked on
        disk and not restarted). KeyError for a node the pool has not now: its facts are not known."""
        if self.pool.single:
            return self.pool.node_of(job)
        if job.node is None:
            return None
        if on_disk(job) and job.node not in self.pool.nodes():
            # Parked to disk on a node that left: any node reaching its checkpoint acts for it
            # (dropping the checkpoint when it is cancelled); it has no process to observe.
            reach = self.pool.disk_nodes(job.node)
            return self.pool.on(reach[0]) if reach else None
        return self.pool.node_of(job)

    def wait_of(self, job: JobRecord) -> Optional[Wait]:
        """Why this job waits (a PENDING or PAUSED job the last round did not start), or None."""
        if job.state not in (JobState.PENDING, JobState.PAUSED) or job.cancel_requested:
            return None
        if job.hold and not job.holds_gpu:
            return HELD
        return self.placement.wait_of(job, self.waits.get(job.id))

    def _explain(self, live: dict[int, JobRecord], waits: dict[str, Wait], now: float) -> None:
        """Keep the policy's reasons, and write one as an event when a job's reason changes in
        substance (its rule or who holds it, not a countdown), so the log says why it waited."""
        kept = {int(k): replace(w, text=self.placement.name_gpus(w.text))
                for k, w in waits.items()}
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
                self.placement.forget(rec.id)
            else:
                self._live[rec.id] = rec
        return self._live

    @property
    def capability(self) -> Capability:
        """What can be parked transparently: this machine's; a pool's summary of its nodes'."""
        return self.pool.capability

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
            grace = self.config.attach_grace_s
            if awaiting_runtime(job, now, grace) and not self._freezable_now(job, tier):
                # Decided on a job still importing its framework, a disk pause would be refused and
                # a RAM one tried on a process with no CUDA state; wait for the attach (or the grace).
                if job.reason != deferred_pause_text(tier, grace):
                    self.store.update(job.id, now, event=NewEvent(K.PAUSE_DEFERRED, deferred_pause_text(tier, grace),
                                                                  tier=tier, initiator="user"))
                return
            if tier not in tiers_for(job, self.placement.cap(job).available):
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
        if tier != "ram" or mechanism_for(job, self.placement.cap(job).available) != "transparent":
            return False
        node = self._node(job)
        return node is not None and node.has_cuda_process(job)

    def _apply(self, d: Decision, job: JobRecord, now: float) -> None:
        detail = {k: getattr(d, k) for k in d.__dataclass_fields__ if k != "job_id"}
        if not self.pool.single:       # its reason names GPUs as people see them in a pool
            d = replace(d, reason=self.placement.name_gpus(d.reason))
        if isinstance(d, (Start, Resume)) and not self.placement.may_enter(job, d.gpus):
            return
        if isinstance(d, Start) and job.state == JobState.PENDING and not job.cancel_requested:
            gen = job.generation + 1
            node, gpus = self.placement.placed(d.gpus)
            self.store.update(job.id, now, state=JobState.RUNNING, assigned=gpus, generation=gen,
                              last_start=now, desired="running", desired_tier=None, attached=False,
                              **({} if node is None else {"node": node}),
                              event=NewEvent(K.STARTED, _with_reason(f"started on {self.placement.where(node, gpus)}",
                                                                     d.reason), initiator="policy"))
            self._launch(job if node is None else replace(job, node=node), gen, gpus)
        elif isinstance(d, Pause) and job.state == JobState.RUNNING and d.tier in tiers_for(job, self.placement.cap(job).available):
            self._pause(job, d.tier, now, d.reason, by="policy")
        elif isinstance(d, Resume) and job.state == JobState.PAUSED and self.placement.on_its_node(job, d):
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
        mech = mechanism_for(job, self.placement.cap(job).available)
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
        # Each node parks in its own RAM: only the jobs of its node count (all of them on one machine).
        held = sum(j.parked_bytes for j in self._live.values()
                   if j.parked == "ram" and j.id != job.id and j.node == job.node)
        inflight = sum(j.ram_allowance or 0 for j in self._live.values()
                       if j.state == JobState.PAUSING and j.desired_tier == "ram" and j.id != job.id
                       and j.node == job.node)
        return max(0, self.pool.ram_budget(job.node, self.config.ram_budget) - held - inflight)

    def ram_budgets(self, nodes: Iterable[str]) -> int | dict[str, int]:
        """Each node's host-RAM budget for parked jobs (one machine: the daemon's)."""
        if self.pool.single:
            return self.config.ram_budget
        return {n: self.pool.ram_budget(n, self.config.ram_budget) for n in nodes}

    def _why_not(self, job: JobRecord) -> str:
        if job.transparent_refused:
            return job.transparent_refused
        if job.width > 1 or job.ram_refusal:      # the multi-rank rules: capability.py says why
            why = job_parkability(job, self.placement.cap(job).available).why_not
            if why:
                return why
        if job.no_runtime:
            return "it reached no safepoint when last asked to pause; it is not asked again"
        if mechanism_for(job, self.placement.cap(job).available) == "transparent":
            unattached = (f"no gpuswap runtime attached within {self.config.attach_grace_s:g} s of its start, and "
                          if job.pause_mode == "auto" and not job.attached else "")
            return f"{unattached}a driver-frozen job is held in RAM; CRIU disk dumps are not supported"
        return f"pause mode {job.pause_mode}; {self.placement.cap(job).reason}"

    def _resume(self, job: JobRecord, d: Resume, now: float) -> None:
        park = job.parked_state
        original = d.gpus                                                  # the pool's ids: which node
        d = Resume(d.job_id, tuple(self.placement.placed(d.gpus)[1]), d.reason)    # its node's own GPU indices
        where = self.placement.where(None if self.pool.single else job.node, list(d.gpus))
        if park is None and job.stopped:     # the SIGSTOP fallback: nothing was moved
            self.store.update(job.id, now, state=JobState.RUNNING, stopped=False, last_start=now,
                              event=NewEvent(K.CONTINUED, _with_reason("continued (SIGCONT)", d.reason),
                                             initiator="policy"))
        elif park is not None and park.tier == "ram":
            movable = park.mechanism == "transparent"
            pinned = park.home_gpus and not (movable and self.placement.cap(job).migration)
            if pinned and sorted(d.gpus) != sorted(park.home_gpus):
                return   # its CUDA context lives on its home GPUs; wait for those
            self.store.update(job.id, now, state=JobState.RESUMING, desired="running", desired_tier=None,
                              assigned=list(d.gpus), event=NewEvent(
                                  K.RESUME_STARTED, _with_reason(f"{'thawing' if movable else 'resuming from RAM'} "
                                                                 f"on {where}", d.reason),
                                  tier="ram", mechanism=park.mechanism, initiator="policy"))
        elif park is not None and park.tier == "disk":
            gen = job.generation + 1
            node = job.node if self.pool.single else self.placement.placed(original)[0]
            moved = "" if node == job.node else f" (moved from {job.node}: its checkpoint is on storage both reach)"
            where = self.placement.where(None if self.pool.single else node, list(d.gpus))
            self.store.update(job.id, now, state=JobState.RESUMING, desired="running", desired_tier=None,
                              assigned=list(d.gpus), generation=gen, attached=False,
                              **({} if node == job.node else {"node": node}), event=NewEvent(
                                  K.RESUME_STARTED, _with_reason(
                                      f"restarting from its disk checkpoint ({format_size(park.nbytes)}) "
                                      f"on {where}{moved}", d.reason),
                                  tier="disk", mechanism="cooperative", initiator="policy"))
            self._launch(job if node == job.node else replace(job, node=node), gen, d.gpus)

    def _launch(self, job: JobRecord, generation: int, gpus: tuple[int, ...] | list[int]) -> None:
        self.pool.node_of(job).launch(job, self.store.env(job.id), generation, list(gpus), Desired(run="running"))

    def _push_desired(self, job: JobRecord) -> None:
        if job.generation == 0 or (job.state == JobState.PAUSED and job.parked == "disk"):
            return
        node = self._node(job)
        if node is None:
            return
        if job.state in ACTIVE and not node.spawned(job.id, job.generation):
            # The daemon died between recording a start and spawning it: spawn now (idempotent).
            self._launch(job, job.generation, job.assigned)
        node.set_desired(job.id, job.generation, Desired(
            run=job.desired, tier=job.desired_tier, sigstop=job.stopped,
            cancel=job.cancel_requested, max_bytes=job.ram_allowance))


def _with_reason(what: str, reason: str) -> str:
    """The policy's reason, led by what we did unless the reason already says it."""
    if not reason:
        return what
    if reason.split()[0].lower()[:5] == what.split()[0].lower()[:5]:
        return reason
    return f"{what}: {reason}"
