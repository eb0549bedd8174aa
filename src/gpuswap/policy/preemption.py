"""The victims of one round, found on first need and kept up to date as the round pauses them.

The rules (who may be paused, at what cost, in which order) are `victims.py`'s; this is how a round
applies them to many waiting jobs without redoing the same work for each. A round pauses victims
one waiting job after another, and each pause changes one node only, so:

* victims are grouped by level and scored only when a group is reached (usually the top one);
* a pause re-scores that node's victims alone, and re-sorts a group only if a key changed;
* the best multi-GPU plan is kept per kind of waiting job (`_signature`) and node, and only the
  nodes the round changed since (`ClusterState.touched`) are planned again: with a deep queue of
  wide jobs, trying all nodes for each made a round of 10,000 jobs cost over 100 ms.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Hashable, Optional

from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.model import JobView, Snapshot
from gpuswap.policy.specs import Ctx, Spec
from gpuswap.policy.victims import Chosen, Victim, eligible, pairs_by_node, plan_on, scored, under_switch_cap

_Plan = tuple[tuple, str, Chosen]        # ((worst victim key, GPU-s, victims, node), node, victims)


@dataclass(slots=True)
class _Group:
    """The victims of one level across the cluster, in victim order once reached."""

    level: tuple
    members: dict[str, list[Victim]]                        # node -> its victims of this level
    left: int = 0                                           # members not taken
    ranked: Optional[list[tuple[tuple, Victim]]] = None     # may still hold victims taken since
    start: int = 0                                          # entries before it are all taken


@dataclass(slots=True)
class _Plans:
    """Per node, the best plan for waiting jobs of one signature, as of `ClusterState.touched[:seen]`."""

    seen: int
    by_node: dict[str, Optional[_Plan]] = field(default_factory=dict)


class Preemption:
    """Victims for the waiting jobs of one round.

    A one-GPU job on a cluster with nothing free and nothing coming free needs one victim: the
    first acceptable one in victim order across all nodes -- the answer trying each node would
    give. Every policy's victim order puts a higher preemption level first (`Spec.victim`), so the
    victims are grouped by level and only the groups actually reached are scored.
    """

    def __init__(self, snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState):
        self.snap, self.spec, self.ctx, self.cl = snap, spec, ctx, cl
        self._eligible = eligible(snap, spec, ctx, cl)
        # Built on need: ~half the rounds never plan, and most plans visit a few nodes' victims.
        self._pairs: Optional[dict[str, list[tuple[JobView, tuple]]]] = None
        self._victims: dict[str, list[Victim]] = {}
        self.max_level = max(self._eligible[1]) if self._eligible[1] else None
        # Built on the first plan (most rounds make none): level -> eligible victims left; the
        # levels, ascending (a waiting job's level matters only by where it falls among them); how
        # many at the top have no victim left; whether plans may be kept (`_plans_for`).
        self._levels: Optional[Counter] = None
        self._gaps: list[tuple] = []
        self._top = 0
        self._memo_ok = False
        self.ranked: dict[str, list[tuple[tuple, Victim]]] = {}   # per node, until a pause there
        self.groups: Optional[list[_Group]] = None    # level descending
        self._first = 0                               # groups before it have no member left
        self._group_of: dict[tuple, _Group] = {}
        self._groups_on: dict[str, list[_Group]] = defaultdict(list)
        self.gone: set[str] = set()                   # victims taken this round
        self.room_at: dict[int, int] = {}             # level gap -> most GPUs one node could free for it
        self._plans: dict[Hashable, _Plans] = {}
        self._scores: dict = {}                       # `victims.scored`'s memo for the round

    def _index(self) -> None:
        if self._levels is None:
            self._levels = Counter(self._eligible[1])
            self._gaps = sorted(self._levels)
            # What a RAM park leaves on a GPU depends on the waiting job's footprint: no memo then.
            self._memo_ok = not self.cl.residue and not any(v.residue_bytes > 0 for v in self._eligible[0])

    @property
    def pairs(self) -> dict[str, list[tuple[JobView, tuple]]]:
        """node -> [(eligible job, its level)]."""
        if self._pairs is None:
            self._pairs = pairs_by_node(*self._eligible, self.cl)
        return self._pairs

    def victims_on(self, node: str) -> list[Victim]:
        vs = self._victims.get(node)
        if vs is None:
            vs = self._victims[node] = [Victim(v, node, lv) for v, lv in self.pairs.get(node, ())]
        return vs

    def _ranked(self, node: str) -> list[tuple[tuple, Victim]]:
        r = self.ranked.get(node)
        if r is None:
            r = self.ranked[node] = scored(self.victims_on(node), self.cl, self.snap, self.spec, self.ctx,
                                           self._scores)
        return r

    def plan(self, w: JobView, lw: tuple) -> Optional[tuple[str, Chosen]]:
        """The best way to make room for `w` anywhere it may run: node and victims, or None."""
        cl, need = self.cl, max(w.gpus, 1)
        nodes = cl.candidate_nodes(w)
        self._index()
        if w.gpus == 1 and cl.max_soon == 0 and nodes is cl.nodes:
            return self._first_acceptable(w, lw)
        if need > self._room(lw, nodes):
            return None                     # no node could free enough GPUs, whatever the gates say
        if nodes is cl.nodes and self._memo_ok:
            plans = self._plans_for(w, lw).values()
        else:
            plans = [self._plan_on(w, lw, node) for node in nodes]
        best = min((p for p in plans if p is not None), key=itemgetter(0), default=None)
        return None if best is None else (best[1], best[2])

    def _signature(self, w: JobView, lw: tuple) -> Hashable:
        """What `plan_on` looks at of a waiting job when no GPU keeps a residue: its level (only
        which victims' levels are above it), its GPUs, and what the benefit gate reads of it
        (`Spec.benefit_rank`)."""
        spec = self.spec
        return (bisect_right(self._gaps, lw), w.gpus,
                spec.benefit_rank(w, self.ctx) if spec.benefit_ok is not None else None)

    def _plans_for(self, w: JobView, lw: tuple) -> dict[str, Optional[_Plan]]:
        """Each node's best plan for `w`, planned again only on the nodes changed since last asked."""
        touched = self.cl.touched
        sig = self._signature(w, lw)
        memo = self._plans.get(sig)
        if memo is None:
            memo = self._plans[sig] = _Plans(len(touched))
            for node in self.cl.nodes:
                memo.by_node[node] = self._plan_on(w, lw, node)
        elif memo.seen < len(touched):
            for node in set(touched[memo.seen:]):
                memo.by_node[node] = self._plan_on(w, lw, node)
            memo.seen = len(touched)
        return memo.by_node

    def _plan_on(self, w: JobView, lw: tuple, node: str) -> Optional[_Plan]:
        cl, need = self.cl, max(w.gpus, 1)
        if not self.pairs.get(node) or self._room(lw, [node]) < need:
            return None
        free, pending = cl.pools_for(w)     # the GPUs w fits on (all, when no GPU keeps a residue)
        plan = plan_on(w, lw, node, self._ranked(node), w.gpus - len(free[node]) - len(pending[node]),
                       cl, self.snap, self.spec, self.ctx)
        if plan is None:
            return None
        chosen, cost, worst = plan
        return (worst, cost, len(chosen), node), node, chosen

    def _room(self, lw: tuple, nodes: list[str]) -> int:
        """An upper bound on the GPUs one of `nodes` could offer a job of level `lw`: its free and
        pending GPUs plus those of its victims of a higher level. Over all nodes it is kept per
        level for the round: a round only takes GPUs and victims away, so the bound stays a bound."""
        cl = self.cl
        everywhere = nodes is cl.nodes
        gap = bisect_right(self._gaps, lw) if everywhere else -1   # jobs in one gap: the same bound
        room = self.room_at.get(gap) if everywhere else None
        if room is None:
            pairs, free, pending = self.pairs, cl.free, cl.pending
            room = 0
            for n in nodes:                 # a node holds a handful of victims: no index pays off
                r = len(free[n]) + len(pending[n])
                for v, lv in pairs.get(n, ()):
                    if lw < lv:
                        r += len(v.assigned)
                if r > room:
                    room = r
            if everywhere:
                self.room_at[gap] = room
        return room

    def plan_for_gpus(self, w: JobView, lw: tuple, node: str, gpus: set[int]) -> Optional[Chosen]:
        """Pause whoever holds these GPUs (a job pinned to them waits for exactly those), or None
        when some holder may not be paused for `w` or a GPU is held by a job in transition."""
        holder_ids = {j.id for j in self.cl.running if gpus.intersection(j.assigned)}
        holders = [(k, c) for k, c in self._ranked(node) if c.job.id in holder_ids]
        if not holders or len(holders) != len(holder_ids):
            return None
        if not gpus <= {g for _, c in holders for g in c.job.assigned}:
            return None
        plan = plan_on(w, lw, node, holders, sum(len(c.job.assigned) for _, c in holders),
                       self.cl, self.snap, self.spec, self.ctx)
        return plan[0] if plan is not None and len(plan[0]) == len(holders) else None

    def _first_acceptable(self, w: JobView, lw: tuple) -> Optional[tuple[str, Chosen]]:
        if self.groups is None:
            by_level: dict[tuple, dict[str, list[Victim]]] = defaultdict(dict)
            for node, pairs in self.pairs.items():   # records of their own: `_rescore` reads their keys
                for v, lv in pairs:
                    by_level[lv].setdefault(node, []).append(Victim(v, node, lv))
            self.groups = [_Group(lv, by_level[lv], sum(map(len, by_level[lv].values())))
                           for lv in sorted(by_level, reverse=True)]
            for group in self.groups:
                self._group_of[group.level] = group
                for node in group.members:
                    self._groups_on[node].append(group)
        cl, snap, spec, ctx, gone, groups = self.cl, self.snap, self.spec, self.ctx, self.gone, self.groups
        # No residue anywhere: a victim scored at its node's RAM version keeps its plan (`plan_on`).
        fast, version, cap, gate = not cl.residue, cl.ram_version, spec.switch_cap, spec.benefit_ok
        while self._first < len(groups) and not groups[self._first].left:
            self._first += 1
        for k in range(self._first, len(groups)):
            group = groups[k]
            if not lw < group.level:
                break                       # every later group is lower still
            if not group.left:
                continue
            if group.ranked is None:
                group.ranked = scored([c for cs in group.members.values() for c in cs], cl, snap, spec, ctx,
                                      self._scores)
            ranked = group.ranked
            while group.start < len(ranked) and ranked[group.start][1].job.id in gone:
                group.start += 1
            for i in range(group.start, len(ranked)):
                vkey, c = ranked[i]
                v = c.job
                if v.id in gone:
                    continue
                if fast and c.seen == version[c.node] and v.residue_bytes <= 0 and v.assigned:
                    # `plan_on` for one victim whose plan is as scored, written out
                    cost = c.plan.per_gpu_s(v)
                    if (not cap or under_switch_cap(v, cost, snap)) and (gate is None or gate(w, v, ctx, cost)):
                        return c.node, [(v, c.plan)]
                    continue
                plan = plan_on(w, lw, c.node, [(vkey, c)], 1, cl, snap, spec, ctx)
                if plan is not None:
                    return c.node, plan[0]
        return None

    def taken(self, node: str, chosen: Chosen) -> None:
        """`chosen` on `node` are being paused: they leave, and that node's RAM room changes."""
        gone = {v.id for v, _ in chosen}
        self.gone |= gone
        self._index()
        kept, lv_of = [], {}
        for v, lv in self.pairs[node]:
            if v.id in gone:
                lv_of[v.id] = lv
                self._levels[lv] -= 1
                if not self._levels[lv]:
                    del self._levels[lv]
            else:
                kept.append((v, lv))
        self.pairs[node] = kept
        self._victims.pop(node, None)       # made again from the pairs on need
        self.ranked.pop(node, None)
        self.cl.touched.append(node)
        if self.groups is not None:
            for v, _ in chosen:
                self._group_of[lv_of[v.id]].left -= 1
            for group in self._groups_on[node]:
                self._rescore(group, node, gone)
        while self._top < len(self._gaps) and self._gaps[-1 - self._top] not in self._levels:
            self._top += 1                  # levels only go: the highest left is found by walking down
        self.max_level = self._gaps[-1 - self._top] if self._top < len(self._gaps) else None

    @property
    def eligible_jobs(self) -> list[JobView]:
        """The running jobs past their protection (`victims.eligible`), this round."""
        return self._eligible[0]

    def close(self, node: str, ids: set[str]) -> None:
        """A reservation on `node` keeps these holders for a job ahead in the order: nobody behind
        it pauses them this round, as if they were taken."""
        left = [(v, None) for v, _ in self.pairs.get(node, ()) if v.id in ids and v.id not in self.gone]
        if left:
            self.taken(node, left)

    def _rescore(self, group: _Group, node: str, gone: set[str]) -> None:
        """`node`'s RAM room changed: score its victims in `group` again. Taken victims stay in
        the ranked list (skipped where it is read) unless a key moved and the group is re-sorted."""
        members = group.members.get(node)
        if not members:
            return
        members = group.members[node] = [c for c in members if c.job.id not in gone]
        if group.ranked is None:
            return
        old = [c.key for c in members]
        fresh = scored(members, self.cl, self.snap, self.spec, self.ctx, self._scores)
        if old != [c.key for c in members]:
            kept = [e for e in group.ranked if e[1].node != node and e[1].job.id not in self.gone]
            kept += fresh
            kept.sort(key=itemgetter(0))
            group.ranked, group.start = kept, 0
