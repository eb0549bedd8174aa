"""The daemon's control loop: observe what is, ask the policy what should be, make the moves.

Level-triggered, as a Kubernetes controller: every tick re-reads the database and every live
job's supervisor status, so a daemon restarted at any instant simply converges. Each move is
written to SQLite *before* it is carried out (a launch is idempotent per generation), and the
API never changes a job's state itself: it records the user's intent (cancel, hold and the tier
asked for) and wakes us; node/moves.py turns it, and the policy's decisions, into moves.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from gpuswap import policy
from gpuswap.jobs import JobState
from gpuswap.lifecycle import STARTED, EventKind as K, NewEvent
from gpuswap.node import observe, residue, snapshot
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.nodebandwidths import NodeBandwidths
from gpuswap.node.cuda_ckpt import Capability
from gpuswap.node.launcher import Launcher
from gpuswap.node.moves import ACTIVE, Moves
from gpuswap.node.placement import Placement, on_disk
from gpuswap.node.pool import Node, Pool
from gpuswap.node.strays import StrayCheck
from gpuswap.node.store import JobRecord, Store
from gpuswap.node.transition import Applier
from gpuswap.policy.model import PolicyConfig, Wait
from gpuswap.policy.classes import class_gpu_s

log = logging.getLogger("gpuswap.controller")

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
        self.moves = Moves(store, pool, self.placement, config, lambda: self._live, self._node)
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
                self._isolated(job, now, "to apply its user's request", self.moves.user_intent, job, now)
        live = self._refresh()
        jobs = sorted(live.values(), key=lambda j: j.id)
        pool_gpus = self.pool.gpus()
        layout = self.placement.relayout(pool_gpus)
        views = self.placement.views([j for j in jobs if snapshot.schedulable(j)])
        seen = {int(v.id) for v in views}
        kept = (residue.outside_snapshot(jobs, seen) if self.pool.single    # e.g. a user's RAM pause
                else snapshot.kept_in_pool(jobs, seen, layout))
        snap = snapshot.build(now, snapshot.pool_gpus(pool_gpus, self.pool.single), views,
                              self.config.policy_config, self.bandwidths.costs(), self.moves.ram_budgets(pool_gpus), self.usage,
                              kept, self.class_usage,
                              None if self.node_bandwidths is None else self.node_bandwidths.costs(pool_gpus))
        decisions = policy.decide(snap, self.config.policy)
        for d in decisions:
            job = live.get(int(d.job_id))
            if job is not None:
                self._isolated(job, now, f"to carry out a {type(d).__name__.lower()}", self.moves.decision, d, job, now)
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
                self._isolated(job, now, "to update what its supervisor is asked", self.moves.push_desired, job)
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
