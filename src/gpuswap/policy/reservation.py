"""Reservations for wide jobs that waited too long (docs/policies.md, rule 6 "No starvation of wide
jobs"; issue 15, item 2).

Backfilling lets narrow jobs behind a waiting wide one take every GPU that frees, so without a
reservation a job of 2 GPUs or more could wait forever. Once it has waited `reserve_after_s` in its
phase, the round (`engine.py`) asks `Reservations.take` to hold for it, on the node that can free its
GPUs soonest, the GPUs it needs there, and to keep the victims it would pause there from the jobs
behind it. Kept apart from the round: it is its own rule with its own per-round memos.
"""
from __future__ import annotations

from typing import Optional

from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.explain import Explainer
from gpuswap.policy.model import JobView, Snapshot
from gpuswap.policy.preemption import Preemption
from gpuswap.policy.specs import Ctx, Spec
from gpuswap.policy.victims import protection, running_levels

# A running job as reservations see it: (job, its level, the GPUs it holds, whether it could be
# paused for someone at all -- preemptible and parkable; then `protection` says when). A tuple,
# not a dataclass: a round makes one for every running job (~500 on 64x8 GPUs), and on the Philly
# trace making them as slotted dataclasses was ~10% of `gpuswap`'s time.
_Holder = tuple[JobView, tuple, int, bool]


class Reservations:
    """One round's reservations (one per node) and what they need to choose a node."""

    # Whether a round takes its shortcuts: keeps what it learnt of each node (refusals, holders it
    # may pause) between the jobs that ask, rules a node out by its holders' levels before working
    # out their protection and order keys, and asks where the holders behind a job cover its need
    # before how soon a node frees (`_choose`). Only a test turns it off, to check that the
    # shortcuts change no decision.
    remember = True

    def __init__(self, snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState, why: Optional[Explainer]):
        self.snap, self.spec, self.ctx, self.cl, self.why = snap, spec, ctx, cl, why
        self.reserved: dict[str, str] = {}         # node -> the waiting job holding its reservation
        # Per node: its running jobs with their levels (`_on`, all nodes in one batch on the first
        # ask of the round: the levels alone answer most asks); built when first needed there,
        # those that could be paused with when (`_parkable_on`) and their order keys (`_held`).
        self._running_on: Optional[dict[str, list[_Holder]]] = None
        self._parkable: dict[str, list[tuple[float, tuple, int, str]]] = {}
        self._held_on: dict[str, list[tuple[tuple, int, str]]] = {}
        self._past: Optional[set[str]] = None
        self._ready: dict[tuple, tuple[tuple, int]] = {}  # (node, level, GPUs) -> (readiness, as of touched[:n])
        self._last_touch: dict[str, int] = {}
        self._lapse_memo: dict[tuple, tuple[list, int, int]] = {}   # (node, level) -> (lapses, as of touched, of gone)
        self._seen = 0
        # Per node, the fewest GPUs a job asked for there and found no reservation: a later job
        # of as many GPUs or more finds none there either, so only the other nodes are tried.
        # Along a round every input of a node's answer only shrinks: jobs come in order, so a
        # later one's level is no lower (fewer holders above it to pause, `_lapses`, less those
        # taken) and its order key is higher (fewer holders rank behind it, `_behind_node`);
        # free and pending GPUs are only taken, and more GPUs are no easier to find. (Not kept
        # while a GPU keeps a residue: then the GPUs a job fits on depend on the job.) On the
        # Philly trace ~99% of the jobs asking were wide jobs parked in RAM on a full node.
        self._none_on: dict[str, int] = {}
        self._none_anywhere = float("inf")          # the same, for every node at once

    def surely_none(self, w: JobView, need: int) -> bool:
        """Whether `take` refuses `w` (needing `need` GPUs) whatever the cluster: a 1-GPU job (it
        gets any GPU that frees before those behind it), a policy without reservations, or a job
        that has not waited `reserve_after_s` yet. Cheap: a full round asks it of every job it passes."""
        after = self.snap.config.reserve_after_s
        return need < 2 or not self.spec.reserves or after is None or self.snap.now - w.phase_since < after

    def take(self, w: JobView, key: tuple, lw: Optional[tuple], need: int, pre: Optional[Preemption]) -> bool:
        """No starvation of wide jobs (issue 15, item 2): once `w` has waited `reserve_after_s` in
        its phase, hold for it, on the node that can free its GPUs soonest (`_readiness`), the free
        and coming-free GPUs it needs there, and let no job behind it in the order pause anyone on
        that node; the node's other free GPUs stay open to backfill. One reservation per node; the
        job's own victims there are paused by the usual rules (its level, protection, switch cap,
        benefit) as soon as they free enough with what is held. Only a job of 2 GPUs or more: only
        it can lose GPUs to narrower jobs behind it. `key`: its order key; `pre`: the round's
        preemption, if built yet. Whether it reserved."""
        if self.surely_none(w, need) or w.holds_gpu_while_paused or w.home_gpus:
            return False     # stopped and pinned jobs already wait for exact GPUs
        cl = self.cl
        if len(self.reserved) == len(cl.nodes):
            return False
        nodes = cl.candidate_nodes(w)
        anywhere = nodes is cl.nodes
        none_on = self._none_on if not cl.residue and self.remember else {}
        if none_on:
            if anywhere and need >= self._none_anywhere:
                return False
            nodes = [n for n in nodes if need < none_on.get(n, need + 1)]
            if not nodes:
                return False
        node = self._choose(w, key, lw, need, pre, nodes)
        if node is None:
            if not cl.residue and self.remember:
                for n in nodes:
                    none_on[n] = min(need, none_on.get(n, need))
                if anywhere:
                    self._none_anywhere = min(need, self._none_anywhere)
            return False
        self.reserved[node] = w.id
        before = self.why.snapshot_pools(node) if self.why is not None else None
        missing = cl.reserve_for(w, node, need)
        cl.refresh()
        # The holders there it would pause first (soonest unprotected) until its need is met are
        # kept for it: nobody behind it pauses them. Others there may still be paused by them.
        lapses = self._lapses(w, lw, node, pre)
        kept = [vid for _, n, vid in lapses[:self._enough(lapses, missing)]]
        if pre is not None and kept:
            pre.close(node, set(kept))
        if self.why is not None:
            self.why.promise(w, node, before, reservation=True, kept=kept)
            held = sorted(before - self.why.snapshot_pools(node))
            self.why.say(w, "Reserved", f"holds a reservation on {node}: waited {self.snap.now - w.phase_since:.0f} s, "
                         f"past the {self.snap.config.reserve_after_s:.0f} s bound; "
                         + (f"GPU {','.join(map(str, held))} held for it, " if held else "")
                         + f"waiting for {missing} more GPU{'s' if missing != 1 else ''} there "
                         f"(no job behind it may start or preempt into them)",
                         waited_s=self.snap.now - w.phase_since, gpus_held=len(held), gpus_missing=missing)
        return True

    def _choose(self, w: JobView, key: tuple, lw: Optional[tuple], need: int, pre: Optional[Preemption],
                candidates: list[str]) -> Optional[str]:
        """The node of `candidates` to hold `w`'s reservation on: the one that can free its GPUs
        soonest, else one where the jobs holding them rank behind it; None when there is none."""
        capacity = self.cl.capacity
        nodes = [n for n in candidates if n not in self.reserved and capacity.get(n, 0) >= need]
        if not nodes:
            return None
        # No node can free its GPUs by preemption alone (`_soonest` never)? Then reserve only
        # where the jobs holding the rest rank behind it in the order (narrower, later or lower
        # jobs, e.g. one that may not be paused): they end in time, and what frees must not go to
        # jobs behind it. Where its GPUs are held by jobs that rank ahead of it, holding GPUs for
        # it would only idle them while it waits its turn: such reservations were 99.6% of those
        # made on a Philly window and cost 24% of the full trace's average JCT (simulator.md).
        # Asked first: `_behind_node` counts every holder `_readiness` counts (those `w` may
        # pause) and more, so where it finds no node `_soonest` finds none either -- and so it
        # was for ~95% of the asks on the full Philly trace, which then skip `_soonest`.
        if self.remember:
            behind = self._behind_node(w, key, lw, nodes, need, pre)
            if behind is None:
                return None
            ready, node = self._soonest(w, lw, need, pre, nodes)
            return behind if ready == float("inf") else node
        ready, node = self._soonest(w, lw, need, pre, nodes)
        return self._behind_node(w, key, lw, nodes, need, pre) if ready == float("inf") else node

    def _behind_node(self, w: JobView, mine: tuple, lw: Optional[tuple], nodes: list[str], need: int,
                     pre: Optional[Preemption]) -> Optional[str]:
        """The node where free and coming-free GPUs, holders `w` may pause and holders that rank
        behind `w` in the order (a key above `mine`, its own) together cover its need (the most
        such GPUs, then the name)."""
        free, pending = self.cl.pools_for(w)
        best: Optional[tuple[int, str]] = None
        prefix = self.spec.level_prefix
        least = mine[:prefix] if prefix and self.remember else None   # the lowest level a holder counted can have
        for node in nodes:
            got = len(free[node]) + len(pending[node])
            if least is not None and got + sum(n for _, lv, n, _ in self._on(node) if not lv < least) < need:
                continue                    # even all holders of its level or above would not do
            if least is not None and (lw is None or lw == least):
                # Those it may pause are of a level above its own, so behind it too: one count,
                # without working out which it may pause (on `turnover`, after every pause).
                got += sum(n for key, n, _ in self._held(node) if key > mine)
            else:
                pausable = {vid for _, _, vid in self._lapses(w, lw, node, pre)}
                for key, n, vid in self._held(node):
                    if vid in pausable or key > mine:
                        got += n
            if got >= need and (best is None or (-got, node) < best):
                best = (-got, node)
        return None if best is None else best[1]

    def _soonest(self, w: JobView, lw: Optional[tuple], need: int, pre: Optional[Preemption],
                 nodes: list[str]) -> tuple[float, str]:
        """The first of `nodes` by `_readiness`: (when it could give `w` its GPUs, the node). Each
        node's readiness is kept for jobs of the same level and width until the round changes that
        node (`ClusterState.touched`): with many nodes and many starving wide jobs, each
        reservation would otherwise estimate every node again."""
        best: Optional[tuple] = None
        if self.cl.residue:                 # the GPUs w fits on depend on w itself
            best = min(self._readiness(w, lw, n, need, pre) for n in nodes)
            return best[0], best[2]
        self._touched_at("")                # brings `_last_touch` up to date
        last, memo, now = self._last_touch, self._ready, len(self.cl.touched)
        for n in nodes:
            hit = memo.get((n, lw, need))
            if hit is not None and hit[1] > last.get(n, -1):
                value = hit[0]
            else:
                value = self._readiness(w, lw, n, need, pre)
                memo[(n, lw, need)] = (value, now)
            if best is None or value < best:
                best = value
        return best[0], best[2]                 # readiness ends with its node

    def _touched_at(self, node: str) -> int:
        """Where `node` was last named in `ClusterState.touched` (-1: not this round)."""
        touched = self.cl.touched
        for k in range(self._seen, len(touched)):
            self._last_touch[touched[k]] = k
        self._seen = len(touched)
        return self._last_touch.get(node, -1)

    def _readiness(self, w: JobView, lw: Optional[tuple], node: str, need: int,
                   pre: Optional[Preemption]) -> tuple:
        """How soon `node` could give `w` its GPUs, from what a live policy knows (running jobs'
        remaining time is not known): its free GPUs and those pauses in flight free now, then the
        GPUs of jobs `w` could pause (preemptible, parkable, of a level above `w`'s) as their
        protection ends. (When that is enough, the time; else never, and then the most GPUs
        that way, the node name.)"""
        free, pending = self.cl.pools_for(w)
        have = len(free[node]) + len(pending[node])
        now = self.snap.now
        if have >= need:
            return (now, -have, node)
        got = total = have
        ready = float("inf")
        if lw is not None:                  # `_lapses` and `_enough` written out: hot
            gone = pre.gone if pre is not None else ()
            if self.remember:               # never, whenever their protection ends: the same answer
                total += sum(n for v, lv, n, parkable in self._on(node) if parkable and lw < lv and v.id not in gone)
                if total < need:
                    return (ready, -total, node)
                total = have
            for t, lv, n, vid in self._parkable_on(node, pre):
                if lw < lv and vid not in gone:
                    total += n
                    if got < need:
                        got += n
                        if got >= need:
                            ready = max(t, now)
        return (ready, -total, node)

    def _lapses(self, w: JobView, lw: Optional[tuple], node: str,
                pre: Optional[Preemption]) -> list[tuple[float, int, str]]:
        """The holders on `node` that `w` could pause, soonest unprotected first: (when, GPUs, id)."""
        if lw is None:
            return []
        gone = pre.gone if pre is not None else ()
        # Kept per (node, level) until the round changes that node or takes a victim anywhere
        # (`gone` only grows): a reservation asks for it, then its node again, job after job.
        hit = self._lapse_memo.get((node, lw)) if self.remember else None
        if hit is not None and hit[1] > self._touched_at(node) and hit[2] == len(gone):
            return hit[0]
        value = [(t, n, vid) for t, lv, n, vid in self._parkable_on(node, pre) if lw < lv and vid not in gone]
        self._lapse_memo[(node, lw)] = (value, len(self.cl.touched), len(gone))
        return value

    @staticmethod
    def _enough(lapses: list[tuple[float, int, str]], missing: int) -> int:
        """How many of `lapses`, in order, free `missing` GPUs (all of them if they cannot)."""
        got = 0
        for k, (_, n, _) in enumerate(lapses):
            if got >= missing:
                return k
            got += n
        return len(lapses)

    def _on(self, node: str) -> list[_Holder]:
        """`node`'s running jobs with their levels: all nodes' in one batch, on the first ask of
        the round (a batch per node cost more than it saved: a round asks about most nodes)."""
        if self._running_on is None:
            running = self.cl.running
            levels = running_levels(self.spec, self.ctx, self.cl)
            by: dict[str, list[_Holder]] = {}
            node_of, job_node = self.cl.node_of, self.cl.job_node
            for v, lv in zip(running, levels):
                n = node_of.get(v.assigned[0]) if v.assigned else None
                by.setdefault(job_node(v) if n is None else n, []).append(
                    (v, lv, len(v.assigned), bool(v.preemptible and v.tiers)))
            self._running_on = by
        return self._running_on.get(node, [])

    def _held(self, node: str) -> list[tuple[tuple, int, str]]:
        """`node`'s running jobs as (order key, GPUs held, id), keys made in one batch."""
        held = self._held_on.get(node)
        if held is None:
            spec, ctx, jobs = self.spec, self.ctx, [h[0] for h in self._on(node)]
            keys = spec.orders(jobs, ctx) if spec.orders else [spec.order(v, ctx) for v in jobs]
            held = self._held_on[node] = [(key, len(v.assigned), v.id) for v, key in zip(jobs, keys)]
        return held

    def _unprotected(self, pre: Optional[Preemption]) -> set[str]:
        """The running jobs known past their protection (the round's victims), once it has them."""
        if pre is None:
            return set()
        if self._past is None:
            self._past = {v.id for v in pre.eligible_jobs}
        return self._past

    def _parkable_on(self, node: str, pre: Optional[Preemption]) -> list[tuple[float, tuple, int, str]]:
        """`node`'s running jobs that could be paused for someone: (when their protection ends,
        level, GPUs, id), soonest first."""
        held = self._parkable.get(node)
        if held is None:
            snap = self.snap
            unprotected = self._unprotected(pre)
            held = self._parkable[node] = []
            for v, lv, n, parkable in self._on(node):
                if not parkable:
                    continue
                why = None if v.id in unprotected else protection(v, snap)   # (the same answer: a shortcut)
                t = snap.now if why is None else snap.now + why[2]["seconds_left"]
                held.append((t, lv, n, v.id))
            held.sort(key=lambda e: (e[0], e[3]))
        return held
