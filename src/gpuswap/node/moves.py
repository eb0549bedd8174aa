"""Carrying out what the controller decided: a policy decision or a user's request becomes a move
recorded in the store (the new state and the event that says why, durable before anything is done),
then the one action that follows it (a launch, what a job's supervisor is asked). Each is
idempotent per tick: a daemon killed between recording a move and acting on it acts on its restart
(`push_desired` spawns a start that was recorded but never spawned). The loop that calls these is
node/controller.py's.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable, Optional

from gpuswap.jobs import JobState, format_size
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node.freezer import (awaiting_runtime, deferred_pause_text, job_parkability,
                                  mechanism_for, tiers_for)
from gpuswap.node.placement import Placement
from gpuswap.node.pool import Node, Pool
from gpuswap.node.store import JobRecord, Store
from gpuswap.policy.model import Decision, Pause, Resume, Spill, Start
from gpuswap.protocol.rundir import Desired

if TYPE_CHECKING:
    from gpuswap.node.controller import ControllerConfig

ACTIVE = (JobState.RUNNING, JobState.PAUSING, JobState.RESUMING)


class Moves:
    """`live`: the controller's live jobs (for the host-RAM room of a park); `node`: the node a job
    with a process is on (the controller's rule), None when it has none."""

    def __init__(self, store: Store, pool: Pool, placement: Placement, config: "ControllerConfig",
                 live: Callable[[], dict[int, JobRecord]], node: Callable[[JobRecord], Optional[Node]]):
        self.store, self.pool, self.placement, self.config = store, pool, placement, config
        self._live, self._node = live, node

    def user_intent(self, job: JobRecord, now: float) -> None:
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

    def decision(self, d: Decision, job: JobRecord, now: float) -> None:
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
        held = sum(j.parked_bytes for j in self._live().values()
                   if j.parked == "ram" and j.id != job.id and j.node == job.node)
        inflight = sum(j.ram_allowance or 0 for j in self._live().values()
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

    def push_desired(self, job: JobRecord) -> None:
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
