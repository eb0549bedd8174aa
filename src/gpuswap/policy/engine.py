"""The one scheduling engine all policies share: serve waiting jobs in policy order, place them,
and pause victims when the policy allows it.

Rules kept here, once, for every policy: whole exclusive GPUs, all of a job's GPUs on one node,
best-fit placement, RAM-parked jobs resume on their own node (and a job pinned to its GPUs on those
GPUs), GPUs of PAUSING/RESUMING jobs stay held, GPUs a pause in flight will free are reserved for the
first waiting job that can use them (so no second round of victims is paused for the same need), a
stopped job's GPUs lent only to jobs that fit beside the memory it keeps, the host-RAM budget, the
memory a RAM park leaves on a GPU kept reserved (`residue.py`), and a reservation for a job that
waited past `config.reserve_after_s` (`reservation.py`, policies with `Spec.reserves`).
Victims: `victims.py` (the rules) and `preemption.py` (a round's victims); the GPUs a round can hand out: `cluster.py`; tiers and costs: `costs.py`.
"""
from __future__ import annotations

from math import inf
from typing import Callable, Optional

from gpuswap.policy import residue
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.costs import job_bytes, spill_order_ok
from gpuswap.policy.explain import Explainer
from gpuswap.policy.model import Decision, JobView, Pause, Phase, Resume, Snapshot, Spill, Start, Wait
from gpuswap.policy.queue import Queue
from gpuswap.policy.policies import make_ctx
from gpuswap.policy.specs import Ctx, Spec
from gpuswap.policy.preemption import Preemption
from gpuswap.policy.reservation import Reservations
from gpuswap.policy.victims import Chosen, may_spill_for


def schedule(snap: Snapshot, spec: Spec) -> list[Decision]:
    ctx = make_ctx(snap, spec)
    cl = ClusterState(snap)
    pre = None
    below: Optional[list[JobView]] = None    # full: the waiting jobs that may pause someone
    if cl.max_free == 0 and cl.max_soon == 0 and not cl.lendable:
        if spec.preemptive:
            pre = Preemption(snap, spec, ctx, cl)
        if pre is not None and pre.max_level is not None and spec.below is not None:
            below = spec.below(cl.waiting, ctx, pre.max_level)
            nobody = not below
        else:
            nobody = (pre is None or pre.max_level is None
                      or (spec.none_below is not None and spec.none_below(cl.waiting, ctx, pre.max_level)))
        if nobody and not any(j.holds_gpu_while_paused for j in cl.special):
            # Full, and nobody may be paused (none at all, or none by any waiting job: all levels
            # are at least the highest victim's): no job can start, resume or preempt, whatever
            # the order, which is not computed -- with a deep queue it is most of a call's cost.
            over = any(n in snap.ram_budget and used > snap.ram_budget[n] for n, used in cl.ram_used.items())
            if not over:
                return []
            return _spills(snap, _queue(cl.in_ram, spec, ctx).in_ram, set(), cl)
    return _Round(snap, spec, ctx, cl, pre=pre, below=below).run()


def schedule_explained(snap: Snapshot, spec: Spec) -> tuple[list[Decision], dict[str, Wait]]:
    """`schedule`, and why each waiting job it passed over waits (the same round, told as it goes;
    the shortcut for a full cluster is skipped: the round reaches the same decisions)."""
    ctx = make_ctx(snap, spec)
    cl = ClusterState(snap)
    r = _Round(snap, spec, ctx, cl, Explainer(snap, spec, ctx, cl))
    out = r.run()
    return out, r.why.waits


class _Round:
    """One pass over the waiting jobs in policy order, each served by the first rule that fits."""

    def __init__(self, snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState,
                 why: Optional[Explainer] = None, pre: Optional[Preemption] = None,
                 below: Optional[list[JobView]] = None):
        self.snap, self.spec, self.ctx, self.cl = snap, spec, ctx, cl
        self.below = below                         # see `_waiting`
        self.why = why                             # explains the jobs passed over (daemon only)
        self.out: list[Decision] = []
        self.pre: Optional[Preemption] = pre       # built on first need: most calls never need it
        self.resumed: set[str] = set()
        self.cleared: set[str] = set()              # RAM-parked jobs spilled to clear their residue
        # Preemption only gets harder as a round goes on (victims are taken, GPUs and RAM room
        # handed out) and waiting jobs come in rising level, so a job like one that found no plan
        # (same GPUs, places and benefit group, rank no lower) finds none either.
        self.no_plan: dict[tuple, float] = {}
        self.reservations = Reservations(snap, spec, ctx, cl, why)
        self.reserved = self.reservations.reserved  # node -> the job holding its reservation (same dict)

    def _waiting(self) -> list[JobView]:
        """The waiting jobs the round must order. All of them, except on a cluster full from the
        start (nothing free, coming free or lendable, and so till the round ends) with no pinned
        or stopped job: there the round serves jobs in order while each may pause someone, and
        the first that may not -- its level at least the highest victim's left, which only falls
        -- ends it. Levels rise along the order, so the jobs below the highest victim's level at
        the start (`Spec.below`) are all it can reach; and the RAM-parked ones, whose order picks
        the spills. The same round, with the order of a deep queue's thousands of jobs no longer
        computed on the many calls where a few may preempt (keys end with the job id: no ties)."""
        cl = self.cl
        if self.below is None or cl.special or self.why is not None:
            return cl.waiting
        below = {j.id for j in self.below}
        return self.below + [j for j in cl.in_ram if j.id not in below]

    def run(self) -> list[Decision]:
        queue = _queue(self._waiting(), self.spec, self.ctx)
        self.cl.set_order(queue.in_ram)
        done = False                        # nothing is left for the jobs still in the queue
        quick = self.why is None and self.spec.level_prefix > 0   # `_passes_over` may answer
        for key, w in queue:
            if quick and not done and self._passes_over(w, key):
                continue
            done = self._visit(w, key, done)
            if done and self.why is None:
                break                       # only pinned and stopped jobs can still move
        if done and self.why is None and self.cl.special:
            special = [i for i, j in enumerate(queue.jobs) if j.holds_gpu_while_paused or j.home_gpus]
            for key, w in queue.rest(special):
                self._visit(w, key, done)
        self.out.extend(_spills(self.snap, queue.in_ram, self.resumed, self.cl))
        return self.out

    def _passes_over(self, w: JobView, key: tuple) -> bool:
        """Whether `_visit` would leave `w` waiting and change nothing, known cheaply: the cluster is
        full, `w` may pause someone by level but is like a job that found no plan (`_preempt`'s memo)
        and cannot take a reservation now. Most visits on a deep queue (1.03 M of 1.16 M, first 5,000
        jobs of VC 6214e9): one call, not five. False is no answer: `_visit` decides."""
        cl, pre = self.cl, self.pre
        if (cl.max_free or cl.max_soon or cl.lendable or pre is None or pre.max_level is None
                or w.holds_gpu_while_paused or w.home_gpus or w.id in self.cleared
                or not key[:self.spec.level_prefix] < pre.max_level):
            return False
        group, rank = self.spec.benefit_rank(w, self.ctx)
        if not rank >= self.no_plan.get((w.gpus, w.node if w.parked == "ram" else None, group), inf):
            return False
        return w.gpus < 2 or self.reservations.surely_none(w, w.gpus)    # 1 GPU: never reserves

    def _visit(self, w: JobView, key: tuple, done: bool) -> bool:
        """Serve `w` by its kind; whether the queue is done (see `_serve`)."""
        if w.id in self.cleared:
            return done                     # leaving RAM for a job ahead of it
        if w.holds_gpu_while_paused:
            self._continue_stopped(w)
        elif w.home_gpus:
            self._serve_pinned(w, key)
        elif not done:
            return self._serve(w, key)
        elif self.why is not None:
            self.why.blocked(w, self._level(w, key), self.out)
        return done

    def _serve(self, w: JobView, key: tuple) -> bool:
        """Start, resume, reserve for, relocate or preempt for `w`, by the first rule that fits.
        True when no job after it in the order can be served either: nothing is free, coming free
        or lendable, and it may pause nobody -- every later job's level is at least as high."""
        cl, need = self.cl, max(w.gpus, 1)
        if cl.max_free == 0 and cl.max_soon == 0 and not cl.lendable:
            lw = self._level_if_may_preempt(w, key)
            if lw is None:
                if self.why is not None or cl.special:    # else no job behind it can be served
                    self._wait(w, key, self._level(w, key), need)   # this round: nothing to reserve against
                return True
            if not self._preempt(w, key, lw, need):
                self._wait(w, key, lw, need)
            return False
        nodes = cl.candidate_nodes(w)
        free, pending = cl.pools_for(w)     # the GPUs w fits on beside any residue (usually all)
        if cl.max_free >= need:
            fit = [n for n in nodes if len(free[n]) >= need]
            if fit:
                node = min(fit, key=lambda n: (len(free[n]), n))      # best fit
                gpus = cl.take(node, need) if free is cl.free else cl.take_these(node, free[node][:need])
                self._run(w, node, gpus, f"on {node} GPU {_ids(gpus)}")
                return False
        if cl.max_soon >= need:
            soon = [n for n in nodes if len(free[n]) + len(pending[n]) >= need]
            if soon:                        # a pause in flight will make room: wait for it
                node = min(soon, key=lambda n: (len(free[n]) + len(pending[n]), n))
                before = self.why.snapshot_pools(node) if self.why is not None else None
                cl.reserve_for(w, node, need)
                cl.refresh()
                if self.why is not None:
                    self._explain_reserved(w, node, before)
                return False
        if cl.lendable:
            lent = cl.lend(need, w.mem_bytes, [n for n in nodes if n not in self.reserved] if self.reserved else nodes)
            if lent is not None:
                node, gpus = lent
                self._run(w, node, gpus, f"on {node} GPU {_ids(gpus)} beside a stopped job's memory")
                return False
        if cl.residue and cl.max_free >= need and self._clear_residue(w, key, nodes, need):
            return False
        if w.parked == "ram" and cl.max_free >= need and "disk" in w.tiers and self.snap.config.allow_disk:
            elsewhere = [n for n in cl.nodes if n != w.node and len(free[n]) >= need
                         and (not w.disk_nodes or n in w.disk_nodes)
                         and (not w.allowed_nodes or n in w.allowed_nodes)]
            if elsewhere:                   # its node is full but GPUs idle elsewhere: relocate via disk
                self.out.append(Spill(w.id, f"{w.node} is busy; moved to disk to resume on another node"))
                self.resumed.add(w.id)
                node = min(elsewhere, key=lambda n: (len(free[n]), n))
                before = self.why.snapshot_pools(node) if self.why is not None else None
                cl.reserve_for(w, node, need)
                cl.refresh()
                if self.why is not None:
                    self.why.promise(w, node, before)
                    self.why.say(w, "Relocating", f"{w.node} is busy: moving its parked state to disk to "
                                                  f"resume on {node}")
                return False
        lw = self._level_if_may_preempt(w, key)
        if lw is None or not self._preempt(w, key, lw, need):
            self._wait(w, key, lw if lw is not None else self._level(w, key), need)
        return False

    def _preempt(self, w: JobView, key: tuple, lw: tuple, need: int) -> bool:
        """Pause victims for `w` if a plan exists; whether it did."""
        group, rank = self.spec.benefit_rank(w, self.ctx)
        like = (w.gpus, w.node if w.parked == "ram" else None, group)
        if rank >= self.no_plan.get(like, inf):
            return False
        found = self.pre.plan(w, lw)
        if found is None:
            self.no_plan[like] = min(rank, self.no_plan.get(like, inf))
            return False
        node, chosen = found
        before = self.why.snapshot_pools(node) if self.why is not None else None
        self.cl.reserve_for(w, node, need)
        self._pause(w, node, chosen)
        if self.why is not None:
            self.why.promise(w, node, before)
            self._explain_pausing(w, chosen)
        return True

    def _wait(self, w: JobView, key: tuple, lw: Optional[tuple], need: int) -> None:
        """`w` gets no GPU this round: it takes a reservation if it has waited long enough."""
        if not self.reservations.take(w, key, lw, need, self.pre) and self.why is not None:
            self.why.blocked(w, lw, self.out)

    def _serve_pinned(self, w: JobView, key: tuple) -> None:
        """A RAM-parked job whose CUDA context stays on its GPUs resumes on exactly those."""
        cl = self.cl
        home = set(w.home_gpus)
        node = cl.node_of.get(w.home_gpus[0])
        if node is None:
            if self.why is not None:
                self.why.say(w, "Resources", f"its own GPU {_ids(w.home_gpus)} is not among this node's GPUs")
            return
        free, pending = set(cl.free[node]), set(cl.pending[node])
        fits = not cl.residue or all(cl.fits(g, w) for g in home)    # beside others' residue
        if home <= free and fits:
            cl.take_exactly(node, home)
            self._run(w, node, tuple(sorted(home)), f"on its own GPU {_ids(sorted(home))}")
        elif home <= free and self._clear_residue(w, key, [node], len(home), home):
            pass
        elif home <= free | pending and fits:
            cl.take_exactly(node, home)     # a pause in flight frees the rest: wait for it
            cl.refresh()
            if self.why is not None:
                self._explain_reserved(w, node, free | pending)
        else:
            lw = self._level_if_may_preempt(w, key)
            chosen = (self.pre.plan_for_gpus(w, lw, node, home - free - pending)
                      if lw is not None and node not in self.reserved else None)
            if chosen is not None:
                cl.take_exactly(node, home)
                self._pause(w, node, chosen)
                if self.why is not None:
                    self.why.promise(w, node, free | pending)
                    self._explain_pausing(w, chosen)
            elif self.why is not None:
                self.why.blocked(w, self._level(w, key), self.out, sorted(home),
                                 f"waiting for its own GPU {_ids(sorted(home))} (its state stays tied to them)")

    def _clear_residue(self, w: JobView, key: tuple, nodes: list[str], need: int,
                       exact: Optional[set[int]] = None) -> bool:
        """Free GPUs `w` does not fit on only because RAM-parked jobs keep a residue there: spill
        those jobs to disk, if `w` may (residue.py), and reserve the GPUs for `w` meanwhile."""
        lw = self._level(w, key)
        if lw is None:
            return False
        snap, spec, ctx, cl = self.snap, self.spec, self.ctx, self.cl
        found = residue.clearing(
            w, nodes, need, cl, lambda p: p.id not in self.resumed and may_spill_for(w, lw, p, snap, spec, ctx),
            lambda p: spec.order(p, ctx), exact)
        if found is None:
            return False
        node, gpus, spills = found
        before = self.why.snapshot_pools(node) if self.why is not None else None
        cl.take_exactly(node, set(gpus))
        cl.refresh()
        ids = {p.id for p in spills}
        for p in spills:
            why = (f"the memory it keeps on GPU {_ids(sorted(set(p.home_gpus) & set(gpus)))} leaves too little "
                   f"for job {w.id}")
            self.out.append(Spill(p.id, f"{why}; moved to disk"))
            if self.why is not None:
                self.why.say(p, "Spilling", f"being moved to disk: {why}")
        self.resumed |= ids
        self.cleared |= ids
        cl.not_spillable(node, ids)
        if self.why is not None:
            self.why.promise(w, node, before)
            g = next(g for g in gpus if not cl.fits(g, w))
            text, numbers = residue.kept_text(w, g, cl)
            self.why.say(w, "Residue", f"GPU {g} is {text}: moving job {', '.join(sorted(ids))} to disk to free it",
                         **numbers)
        return True

    def _continue_stopped(self, w: JobView) -> None:
        """A stopped job (SIGSTOP fallback) continues once nobody computes on its GPUs."""
        cl = self.cl
        if all(g in cl.lendable for g in w.assigned):
            for g in w.assigned:
                del cl.lendable[g]
            self.out.append(Resume(w.id, tuple(w.assigned), "resumed on the GPUs it kept while paused"))
            self.resumed.add(w.id)
        elif self.why is not None:
            self.why.blocked(w, None, self.out, list(w.assigned),
                             f"stopped on GPU {_ids(w.assigned)}, which another job is using")

    def _level(self, w: JobView, key: tuple) -> Optional[tuple]:
        """`w`'s preemption level (None under a policy that never preempts), for explanations."""
        if not self.spec.preemptive:
            return None
        return key[:self.spec.level_prefix] if self.spec.level_prefix else self.spec.level(w, self.ctx)

    def _explain_reserved(self, w: JobView, node: str, before: set[int]) -> None:
        self.why.promise(w, node, before)
        pausing = sorted({j.id for j in self.snap.jobs if j.phase is Phase.PAUSING
                          and any(self.why.promised.get(g) == w.id for g in j.assigned)})
        self.why.say(w, "Preempting", f"waiting for GPUs a pause in flight frees (job {', '.join(pausing)} "
                     f"{'is' if len(pausing) == 1 else 'are'} being parked)" if pausing
                     else "waiting for GPUs a pause in flight frees")

    def _explain_pausing(self, w: JobView, chosen: Chosen) -> None:
        ids = ", ".join(v.id for v, _ in chosen)
        spilling = any(plan.spill for _, plan in chosen)
        self.why.say(w, "Preempting", f"pausing job {ids} to free GPUs for it"
                     + (" (first moving parked jobs from RAM to disk to make room)" if spilling else ""),
                     switch_s=sum(plan.gpu_s for _, plan in chosen))

    def _level_if_may_preempt(self, w: JobView, key: tuple) -> Optional[tuple]:
        """`w`'s preemption level, or None when nobody can be paused for it."""
        if not self.spec.preemptive:
            return None
        if self.pre is None:
            self.pre = Preemption(self.snap, self.spec, self.ctx, self.cl)
        if self.pre.max_level is None:
            return None
        lw = key[:self.spec.level_prefix] if self.spec.level_prefix else self.spec.level(w, self.ctx)
        return lw if lw < self.pre.max_level else None

    def _run(self, w: JobView, node: str, gpus: tuple[int, ...], where: str) -> None:
        cl = self.cl
        if w.phase is Phase.PAUSED:
            self.out.append(Resume(w.id, gpus, f"resumed {where}"))
            if w.parked == "ram":           # no longer a candidate to spill for room
                cl.not_spillable(node, {w.id})
        else:
            self.out.append(Start(w.id, gpus, f"started {where}"))
        self.resumed.add(w.id)
        cl.refresh()

    def _pause(self, w: JobView, node: str, chosen: Chosen) -> None:
        cl = self.cl
        for v, plan in chosen:
            if plan.spill:                  # v is paused once the room exists: w waits for it
                spilled = {p.id for p in plan.spill}
                for p in plan.spill:
                    self.out.append(Spill(p.id, f"making room in host RAM on {node} to park job {v.id}"))
                self.resumed |= spilled
                cl.not_spillable(node, spilled)
                continue
            self.out.append(Pause(v.id, plan.tier, self.spec.why(w, v, self.ctx)))
            if plan.tier == "ram":
                cl.park_into_ram(node, job_bytes(v))
        self.pre.taken(node, chosen)
        cl.refresh()


def _ids(gpus) -> str:
    return ",".join(map(str, gpus))


def _queue(jobs: list[JobView], spec: Spec, ctx: Ctx) -> Queue:
    """The waiting jobs in policy order, served lazily (queue.py)."""
    return Queue(jobs, spec.orders(jobs, ctx) if spec.orders else [spec.order(j, ctx) for j in jobs])


def _spills(snap: Snapshot, in_ram: Callable[[], list[JobView]], resumed: set[str],
            cl: ClusterState) -> list[Decision]:
    """Keep each node's RAM-parked bytes within its budget by spilling the lowest-ranked to disk
    (`in_ram`: the RAM-parked jobs in policy order, asked for only when a node is over)."""
    out: list[Decision] = []
    for node in cl.nodes:
        if node not in snap.ram_budget or cl.ram_used.get(node, 0) <= snap.ram_budget[node]:
            continue
        excess = cl.ram_used[node] - snap.ram_budget[node]
        for j in reversed(in_ram()):
            if excess <= 0:
                break
            if (j.phase == Phase.PAUSED and j.node == node and j.id not in resumed
                    and spill_order_ok(j, snap.config)):
                out.append(Spill(j.id, f"host-RAM park budget on {node} exceeded; moved to disk"))
                excess -= j.parked_bytes
    return out
