"""What one scheduling round knows about the GPUs: free, coming free, lendable, RAM room, per node.

Built on every call with every live job, so it partitions with comprehensions and derives the free
GPUs from a set difference: the simulator calls it hundreds of thousands of times. Mutated as the
round hands out GPUs, so later waiting jobs see what earlier ones took.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

from gpuswap.policy.costs import job_bytes, ram_free_by_node
from gpuswap.policy.model import JobView, Phase, Snapshot

_TOPOLOGY: list = [None, None]   # memo of the last GPU tuple's layout (the daemon's rarely changes)


def _topology(gpus: tuple) -> tuple[dict[int, str], list[str], frozenset[int], dict[int, int], dict[int, int],
                                   dict[str, int]]:
    """GPU id -> node, the sorted node names, the healthy GPU ids, GPU id -> memory, GPU id -> the
    residue of jobs outside the snapshot (usually empty), node -> its healthy GPUs."""
    if _TOPOLOGY[0] is not gpus:
        capacity: dict[str, int] = {}
        for g in gpus:
            if g.healthy:
                capacity[g.node] = capacity.get(g.node, 0) + 1
        _TOPOLOGY[0], _TOPOLOGY[1] = gpus, ({g.id: g.node for g in gpus}, sorted({g.node for g in gpus}),
                                            frozenset(g.id for g in gpus if g.healthy),
                                            {g.id: g.mem_total for g in gpus},
                                            {g.id: g.residue_bytes for g in gpus if g.residue_bytes > 0},
                                            capacity)
    return _TOPOLOGY[1]


class ClusterState:
    """Free GPUs, GPUs a pause in flight will free (`pending`), GPUs whose only holder is a stopped
    job (`lendable`, with the memory it leaves), each node's host-RAM room, the RAM-parked
    jobs that could be spilled to make room (`spillable_on`, from the tail of the policy order),
    and the memory RAM-parked jobs keep on GPUs nobody computes on (`residue`, see `fits`)."""

    def __init__(self, snap: Snapshot):
        # (Shared with every round on the same GPUs: read only. `capacity`: node -> healthy GPUs.)
        self.node_of, self.nodes, healthy, mem_total, outside, self.capacity = _topology(snap.gpus)
        self.mem_total = mem_total
        # GPU -> bytes a cooperative RAM park left there (and, for a RAM pause in flight, will
        # leave), and the PAUSED jobs that keep it. Empty in most rounds (and the simulator's).
        self.residue: dict[int, int] = dict(outside)
        self.residue_of: dict[int, list[JobView]] = {}
        jobs = snap.jobs
        running, pending, paused, pausing = Phase.RUNNING, Phase.PENDING, Phase.PAUSED, Phase.PAUSING
        self.running: list[JobView] = [j for j in jobs if j.phase is running]
        self.waiting: list[JobView] = [j for j in jobs if j.phase is pending or j.phase is paused]
        self.running_levels: Optional[list[tuple]] = None   # the policy's, on first need (victims.py)
        # Stopped (SIGSTOP fallback) and pinned waiting jobs: served even after the rest of the
        # queue is done for the round. Usually none.
        self.special: list[JobView] = [j for j in self.waiting if j.holds_gpu_while_paused or j.home_gpus]
        held = {g for j in self.running for g in j.assigned}
        self.ram_used: dict[str, int] = defaultdict(int)
        self.pending: dict[str, list[int]] = defaultdict(list)
        stopped: dict[int, int] = {}        # GPU -> bytes a stopped job keeps on it
        ram_used, job_node = self.ram_used, self.job_node
        # The RAM-parked waiting jobs (PENDING jobs park nothing), in snapshot order.
        self.in_ram: list[JobView] = [j for j in self.waiting if j.parked == "ram" and j.phase is paused]
        for j in self.in_ram:
            ram_used[j.node or job_node(j)] += j.parked_bytes or job_bytes(j)
        for j in self.special:              # only these can keep a residue (on their home GPUs) or GPUs
            if j.phase is not paused:
                continue
            if j.parked == "ram" and j.residue_bytes > 0 and j.home_gpus:
                self._add_residue(j, j.home_gpus)
            if j.holds_gpu_while_paused:
                for g in j.assigned:
                    stopped[g] = stopped.get(g, 0) + j.mem_bytes
        if len(self.running) + len(self.waiting) < len(jobs):
            for j in jobs:                  # pauses and resumes in flight (few)
                ph = j.phase
                if ph is running or ph is pending or ph is paused:
                    continue
                held.update(j.assigned)
                if ph is pausing:
                    self.pending[self.job_node(j)].extend(g for g in j.assigned if g in self.node_of)
                    if j.parked == "ram":
                        self.ram_used[j.node or self.job_node(j)] += j.parked_bytes or job_bytes(j)
                        if j.residue_bytes > 0:     # what its park is expected to leave
                            self._add_residue(j, j.assigned)
        self.lendable: dict[int, int] = {g: mem_total.get(g, 0) - kept - self.residue.get(g, 0)
                                         for g, kept in stopped.items() if g not in held and g in healthy}
        held.update(stopped)
        self.free: dict[str, list[int]] = {n: [] for n in self.nodes}
        node_of = self.node_of
        for gid in sorted(healthy.difference(held)):     # usually few: the cluster is mostly busy
            self.free[node_of[gid]].append(gid)
        self.ram_free = ram_free_by_node(snap.ram_budget, self.ram_used, set(self.nodes))
        self.ram_version: dict[str, int] = defaultdict(int)   # bumped when a node's RAM room or spillables change
        # Every node whose free or pending GPUs, RAM room or spillables changed, in order: victim
        # plans made earlier in the round stay valid on the nodes not named since (victims.py).
        self.touched: list[str] = []
        self._order: Callable[[], list[JobView]] = list
        self._spillable: Optional[dict[str, list[JobView]]] = None
        self._not_spillable: set[str] = set()
        self.refresh()

    def _add_residue(self, j: JobView, gpus: tuple[int, ...]) -> None:
        for g in gpus:
            self.residue[g] = self.residue.get(g, 0) + j.residue_bytes
            if j.phase is Phase.PAUSED:
                self.residue_of.setdefault(g, []).append(j)

    def fits(self, g: int, w: JobView, extra: int = 0) -> bool:
        """`w`'s known footprint fits on GPU `g` beside the residue there (and `extra` bytes more).
        The residue counts `w`'s own when `g` is its home: what it keeps is part of its footprint
        when it resumes. A job of unknown footprint (0), or a GPU of unknown size, fits."""
        kept = self.residue.get(g, 0) + extra
        if kept <= 0 or w.mem_bytes <= 0:
            return True
        total = self.mem_total.get(g, 0)
        return total <= 0 or kept + w.mem_bytes <= total

    def pools_for(self, w: JobView) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The free and pending GPUs `w` fits on, per node: the pools themselves when no GPU has
        a residue (every round of the simulator), else filtered copies."""
        if not self.residue:
            return self.free, self.pending
        fits = self.fits
        return ({n: [g for g in gs if fits(g, w)] for n, gs in self.free.items()},
                {n: [g for g in self.pending.get(n, ()) if fits(g, w)] for n in self.nodes})

    def take_these(self, node: str, gpus: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """Take these free GPUs (chosen from `pools_for`) out of the free pool."""
        self.take_exactly(node, set(gpus))
        return tuple(gpus)

    def reserve_for(self, w: JobView, node: str, need: int) -> int:
        """`reserve` of the GPUs `w` fits on; how many are still missing."""
        if not self.residue:
            return self.reserve(node, need)
        free, pending = self.pools_for(w)
        got = free[node][:need] + pending[node][:max(0, need - len(free[node]))]
        self.take_exactly(node, set(got))
        return need - len(got)

    def park_into_ram(self, node: str, nbytes: int) -> None:
        self.ram_free[node] -= nbytes
        self.ram_version[node] += 1
        self.touched.append(node)

    def set_order(self, in_ram: Callable[[], list[JobView]]) -> None:
        """How to get the RAM-parked waiting jobs in policy order (spill candidates are taken from
        its tail); asked only when a round runs short of RAM room."""
        self._order = in_ram

    def spillable_on(self, node: str) -> list[JobView]:
        """RAM-parked jobs on `node` that could be spilled to disk, least deserving first. Built on
        first need: most rounds never run short of RAM room."""
        if self._spillable is None:
            self._spillable = defaultdict(list)
            for j in reversed(self._order()):
                if (j.phase is Phase.PAUSED and j.parked == "ram" and j.id not in self._not_spillable
                        and not j.holds_gpu_while_paused and "disk" in j.tiers):
                    self._spillable[j.node or self.job_node(j)].append(j)
        return self._spillable[node]

    def not_spillable(self, node: str, ids: set[str]) -> None:
        """These jobs leave RAM this round (resumed, or already being spilled)."""
        self._not_spillable |= ids
        self.ram_version[node] += 1
        self.touched.append(node)
        if self._spillable is not None:
            self._spillable[node] = [p for p in self._spillable[node] if p.id not in ids]

    def job_node(self, j: JobView) -> str:
        for g in j.assigned:
            if g in self.node_of:
                return self.node_of[g]
        return j.node or ""

    def refresh(self) -> None:
        free = self.free
        self.max_free = max(map(len, free.values()), default=0)
        soon = [len(free[n]) + len(p) for n, p in self.pending.items() if p]
        self.max_soon = max(self.max_free, max(soon)) if soon else self.max_free

    def take(self, node: str, need: int) -> tuple[int, ...]:
        got = tuple(self.free[node][:need])
        del self.free[node][:need]
        self.touched.append(node)
        return got

    def take_exactly(self, node: str, gpus: set[int]) -> None:
        """Take these GPUs out of the free and pending pools (a pinned job's own GPUs)."""
        self.free[node] = [g for g in self.free[node] if g not in gpus]
        self.pending[node] = [g for g in self.pending[node] if g not in gpus]
        self.touched.append(node)

    def reserve(self, node: str, need: int) -> int:
        """Reserve up to `need` free then pending GPUs on `node`; return how many are still missing."""
        n_free = min(need, len(self.free[node]))
        del self.free[node][:n_free]
        n_pend = min(need - n_free, len(self.pending[node]))
        del self.pending[node][:n_pend]
        self.touched.append(node)
        return need - n_free - n_pend

    def lend(self, need: int, mem_bytes: int, nodes: list[str]) -> Optional[tuple[str, tuple[int, ...]]]:
        """`need` GPUs on one of `nodes` whose stopped holder leaves at least `mem_bytes` free on
        each; taken out of the pool. A job of unknown footprint (0) borrows nothing."""
        if mem_bytes <= 0 or not self.lendable:
            return None
        by_node: dict[str, list[int]] = defaultdict(list)
        for g in sorted(self.lendable):
            if self.lendable[g] >= mem_bytes and self.node_of[g] in nodes:
                by_node[self.node_of[g]].append(g)
        fit = sorted((len(gs), n) for n, gs in by_node.items() if len(gs) >= need)
        if not fit:
            return None
        node = fit[0][1]
        got = tuple(by_node[node][:need])
        for g in got:
            del self.lendable[g]
        return node, got

    def candidate_nodes(self, w: JobView) -> list[str]:
        """Where `w` may run: a RAM-parked job only on the node holding its state, a disk-parked
        one where its checkpoint is reachable (`disk_nodes`; empty: anywhere); in a pool only
        where its working directory can be entered (`allowed_nodes`; empty: anywhere)."""
        if w.phase is Phase.PAUSED and w.parked == "ram" and w.node:
            return [w.node] if w.node in self.ram_free else []
        if w.phase is Phase.PAUSED and w.parked == "disk" and w.disk_nodes:
            return [n for n in self.nodes if n in w.disk_nodes and (not w.allowed_nodes or n in w.allowed_nodes)]
        if w.allowed_nodes:
            return [n for n in self.nodes if n in w.allowed_nodes]
        return self.nodes
