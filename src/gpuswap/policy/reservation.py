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
from gpuswap.policy.victims import protection


class Reservations:
    """One round's reservations (one per node) and what they need to choose a node."""

    # Whether a round keeps what it learnt of each node (refusals, holders it may pause) between
    # the jobs that ask: only a test turns it off, to check that keeping it changes no decision.
    remember = True

    def __init__(self, snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState, why: Optional[Explainer]):
        self.snap, self.spec, self.ctx, self.cl, self.why = snap, spec, ctx, cl, why
        self.reserved: dict[str, str] = {}         # node -> the waiting job holding its reservation
        self._parkable: Optional[dict[str, list[tuple[float, tuple, int, str]]]] = None
        self._capacity: Optional[dict[str, int]] = None  # node -> healthy GPUs (on the first reservation)
        self._ready: dict[tuple, tuple[tuple, int]] = {}  # (node, level, GPUs) -> (readiness, as of touched[:n])
        self._last_touch: dict[str, int] = {}
        self._lapse_memo: dict[tuple, tuple[list, int, int]] = {}   # (node, level) -> (lapses, as of touched, of gone)
        self._seen = 0
        # Per node, its running jobs' (order key, GPUs held, id), built once per round on the
        # first fallback (`_behind_node`): each use then reads one node's few jobs, not them all.
        self._held_on: Optional[dict[str, list[tuple[tuple, int, str]]]] = None
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

    def take(self, w: JobView, key: tuple, lw: Optional[tuple], need: int, pre: Optional[Preemption]) -> bool:
        """No starvation of wide jobs (issue 15, item 2): once `w` has waited `reserve_after_s` in
        its phase, hold for it, on the node that can free its GPUs soonest (`_readiness`), the free
        and coming-free GPUs it needs there, and let no job behind it in the order pause anyone on
        that node; the node's other free GPUs stay open to backfill. One reservation per node; the
        job's own victims there are paused by the usual rules (its level, protection, switch cap,
        benefit) as soon as they free enough with what is held. Only a job of 2 GPUs or more: only
        it can lose GPUs to narrower jobs behind it. `key`: its order key; `pre`: the round's
        preemption, if built yet. Whether it reserved."""
        after = self.snap.config.reserve_after_s
        if (need < 2 or not self.spec.reserves or after is None or self.snap.now - w.phase_since < after
                or w.holds_gpu_while_paused or w.home_gpus):
            return False     # a 1-GPU job gets any GPU that frees before those behind it; stopped
                             # and pinned jobs already wait for exact GPUs
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
                         f"past the {after:.0f} s bound; "
                         + (f"GPU {','.join(map(str, held))} held for it, " if held else "")
                         + f"waiting for {missing} more GPU{'s' if missing != 1 else ''} there "
                         f"(no job behind it may start or preempt into them)",
                         waited_s=self.snap.now - w.phase_since, gpus_held=len(held), gpus_missing=missing)
        return True

    def _choose(self, w: JobView, key: tuple, lw: Optional[tuple], need: int, pre: Optional[Preemption],
                candidates: list[str]) -> Optional[str]:
        """The node of `candidates` to hold `w`'s reservation on: the one that can free its GPUs
        soonest, else one where the jobs holding them rank behind it; None when there is none."""
        if self._capacity is None:
            self._capacity = {}
            for g in self.snap.gpus:
                if g.healthy:
                    self._capacity[g.node] = self._capacity.get(g.node, 0) + 1
        nodes = [n for n in candidates if n not in self.reserved and self._capacity.get(n, 0) >= need]
        if not nodes:
            return None
        ready, node = self._soonest(w, lw, need, pre, nodes)
        if ready == float("inf"):
            # No node can free its GPUs by preemption alone. Reserve only where the jobs holding
            # the rest rank behind it in the order (narrower, later or lower jobs, e.g. one that
            # may not be paused): they end in time, and what frees must not go to jobs behind it.
            # Where its GPUs are held by jobs that rank ahead of it, holding GPUs for it would
            # only idle them while it waits its turn: such reservations were 99.6% of those made
            # on a Philly window and cost 24% of the full trace's average JCT (simulator.md).
            return self._behind_node(w, key, lw, nodes, need, pre)
        return node

    def _behind_node(self, w: JobView, mine: tuple, lw: Optional[tuple], nodes: list[str], need: int,
                     pre: Optional[Preemption]) -> Optional[str]:
        """The node where free and coming-free GPUs, holders `w` may pause and holders that rank
        behind `w` in the order (a key above `mine`, its own) together cover its need (the most
        such GPUs, then the name)."""
        held_on = self._held_on
        if held_on is None:                 # the running jobs' order keys by node, once per round
            spec, ctx, job_node, running = self.spec, self.ctx, self.cl.job_node, self.cl.running
            keys = spec.orders(running, ctx) if spec.orders else [spec.order(v, ctx) for v in running]
            held_on = self._held_on = {}
            for v, key in zip(running, keys):
                held_on.setdefault(job_node(v), []).append((key, len(v.assigned), v.id))
        free, pending = self.cl.pools_for(w)
        best: Optional[tuple[int, str]] = None
        for node in nodes:
            pausable = {vid for _, _, vid in self._lapses(w, lw, node, pre)}
            got = len(free[node]) + len(pending[node])
            for key, n, vid in held_on.get(node, ()):
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
            for t, lv, n, vid in self._parkable_on(pre).get(node, ()):
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
        value = [(t, n, vid) for t, lv, n, vid in self._parkable_on(pre).get(node, ()) if lw < lv and vid not in gone]
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

    def _parkable_on(self, pre: Optional[Preemption]) -> dict[str, list[tuple[float, tuple, int, str]]]:
        """Per node, its running jobs that could be paused for someone: (when their protection
        ends, level, GPUs, id), soonest first. Built once per round, on the first reservation."""
        if self._parkable is None:
            self._parkable = {}
            snap, spec, ctx, cl = self.snap, self.spec, self.ctx, self.cl
            jobs = [v for v in cl.running if v.preemptible and v.tiers]
            levels = spec.running_levels(jobs, ctx) if spec.running_levels else [spec.level(v, ctx) for v in jobs]
            unprotected = {v.id for v in pre.eligible_jobs} if pre is not None else set()
            for v, lv in zip(jobs, levels):
                why = None if v.id in unprotected else protection(v, snap)
                if why is None:
                    t = snap.now
                elif "seconds_left" in why[2]:
                    t = snap.now + why[2]["seconds_left"]
                else:
                    continue
                self._parkable.setdefault(cl.job_node(v), []).append((t, lv, len(v.assigned), v.id))
            for held in self._parkable.values():
                held.sort(key=lambda e: (e[0], e[3]))
        return self._parkable
