"""Why a waiting job got no GPU this round: the rule that holds it, with its numbers.

Asked by the engine (only when the caller wants explanations: the daemon, not the simulator) at
the moment a job is passed over, so it sees the round exactly as the decision did: the GPUs
already handed out or promised to jobs ahead of it, victims being paused, the host-RAM room left.
Every holder of a GPU the job needs is put through the gates `victims.eligible` and
`victims.plan_on` apply (eligibility, preemption level, a park plan, the switch-time cap, benefit
versus cost), with the same predicates; the first that refuses is its reason (the protection after
a start or resume, which runs out, is named after a preemption level, which does not). Nothing
here changes the round.
"""
from __future__ import annotations

from typing import Optional, Sequence

from gpuswap.jobs import format_size
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.costs import costs_on, park_plan
from gpuswap.policy.residue import after_park, kept_text
from gpuswap.policy.model import Blocker, JobView, Pause, Phase, Resume, Snapshot, Start, Wait
from gpuswap.policy.classes import class_of, describe, floor_refusal
from gpuswap.policy.gpuswap import gs_band, may_take_by_promotion
from gpuswap.policy.specs import Ctx, Spec, label, las_queue, service_s, starving
from gpuswap.policy.victims import protection, switch_cap_numbers, under_switch_cap


class Explainer:
    """The waits of one round. The engine tells it what the round promised (`promise`)."""

    def __init__(self, snap: Snapshot, spec: Spec, ctx: Ctx, cl: ClusterState):
        self.snap, self.spec, self.ctx, self.cl = snap, spec, ctx, cl
        self.waits: dict[str, Wait] = {}
        self.promised: dict[int, str] = {}     # GPU -> waiting job it is reserved for this round
        self.reservations: dict[str, str] = {}  # node -> job holding a reservation on it (issue 15, item 2)
        self.reserved_gpus: set[int] = set()    # GPUs such a reservation holds
        self.kept_for: dict[str, str] = {}      # running job -> the reservation it may be paused for only
        self.holders: dict[int, JobView] = {}
        for j in snap.jobs:
            if j.phase in (Phase.RUNNING, Phase.PAUSING, Phase.RESUMING) or j.holds_gpu_while_paused:
                for g in j.assigned:
                    self.holders[g] = j

    # -- what the round did ------------------------------------------------------------------
    def snapshot_pools(self, node: str) -> set[int]:
        return set(self.cl.free.get(node, ())) | set(self.cl.pending.get(node, ()))

    def promise(self, w: JobView, node: str, before: set[int], reservation: bool = False,
                kept: Sequence[str] = ()) -> None:
        """GPUs that left node's free and pending pools for `w` (`reservation`: held for a job that
        waited past the bound, with the whole node closed to jobs behind it)."""
        for g in before - self.snapshot_pools(node):
            self.promised[g] = w.id
            if reservation:
                self.reserved_gpus.add(g)
        if reservation:
            self.reservations[node] = w.id
            for vid in kept:
                self.kept_for[vid] = w.id

    def say(self, w: JobView, code: str, text: str, **numbers: float) -> None:
        self.waits[w.id] = Wait(w.id, code, text, numbers)

    # -- why not ----------------------------------------------------------------------------
    def blocked(self, w: JobView, lw: Optional[tuple], out: list, gpus: Optional[list[int]] = None,
                lead: str = "") -> None:
        """Explain `w` from the holders of the GPUs it needs (`gpus`: exactly these, for a job
        pinned to its own GPUs or stopped on them; else any `w.gpus` on one node it may use)."""
        cl, snap = self.cl, self.snap
        given = {g: d.job_id for d in out if isinstance(d, (Start, Resume)) for g in d.gpus}
        pausing_now = {d.job_id: d for d in out if isinstance(d, Pause)}
        if gpus is None:
            nodes = cl.candidate_nodes(w)
            if not nodes:
                self.say(w, "Resources", _nowhere(w, cl.nodes))
                return
            node = max(nodes, key=lambda n: (len(cl.free[n]), n == w.node, n))
            wanted = [g.id for g in snap.gpus if g.node == node]
        else:
            node, wanted = (cl.node_of.get(gpus[0], "") if gpus else ""), sorted(gpus)
        need = max(w.gpus, 1) if gpus is None else len(wanted)
        free = [g for g in wanted if g in cl.free.get(node, ()) and cl.fits(g, w)]
        kept = [g for g in wanted if g in cl.free.get(node, ()) and not cl.fits(g, w)]   # a residue
        parts: list[tuple[str, list[int]]] = []       # (description, GPUs), in GPU order, grouped
        blockers: list[Blocker] = []
        by_desc: dict[str, list[int]] = {}
        for g in wanted:
            if g in free:
                continue
            holder = self.holders.get(g)
            if holder is not None and holder.id == w.id:
                continue
            if g in kept:
                desc, numbers = kept_text(w, g, cl)
                holders = [p for p in cl.residue_of.get(g, ()) if p.id != w.id]
                b = Blocker(holders[0].id, tuple(holders[0].home_gpus), "Residue",
                            f"parked in RAM, keeps {format_size(holders[0].residue_bytes)} on GPU {g}",
                            numbers) if holders else None
            elif g in given:
                desc, b = f"given to job {given[g]} this round", None
            elif g in self.reserved_gpus:
                desc, b = f"reserved for job {self.promised[g]}, which has waited too long", None
            elif g in self.promised:
                desc, b = f"promised to job {self.promised[g]}, ahead in the queue", None
            elif holder is None:
                desc, b = "unhealthy", None
            else:
                code, text, numbers = self._holder(w, lw, holder, node, pausing_now)
                desc = f"held by job {holder.id} ({text})"
                b = Blocker(holder.id, tuple(x for x in holder.assigned), code, text, numbers)
            if desc not in by_desc:
                by_desc[desc] = []
                parts.append((desc, by_desc[desc]))
                if b is not None:
                    blockers.append(b)
            by_desc[desc].append(g)
        where = f" on {node}" if len(cl.nodes) > 1 else ""
        head = lead or (f"waiting for {need} GPU{'s' if need != 1 else ''}{where}"
                        + (f" ({len(free)} free)" if free else ""))
        text = head + ": " + "; ".join(f"GPU {','.join(map(str, gs))} {d}" for d, gs in parts) if parts else head
        code = ("Reserved" if any(g in self.reserved_gpus for g in wanted)    # the one reason it waits there
                else blockers[0].code if blockers else "Residue" if kept else "Priority"
                if any(g in self.promised or g in given for g in wanted) else "Resources")
        self.waits[w.id] = Wait(w.id, code, text, {"gpus_needed": need, "gpus_free": len(free)}, tuple(blockers))

    def _holder(self, w: JobView, lw: Optional[tuple], v: JobView, node: str,
                pausing_now: dict) -> tuple[str, str, dict[str, float]]:
        """The first rule that keeps `v` on its GPUs for `w`: plan_on's gates, in its order."""
        snap, spec, ctx = self.snap, self.spec, self.ctx
        if v.id in pausing_now:
            return "Preempting", f"being paused this round: {pausing_now[v.id].reason}", {}
        if v.phase is Phase.PAUSING:
            return "Preempting", "being paused; its GPUs are freed once it is parked", {}
        if v.phase is Phase.RESUMING:
            return "Resources", "resuming", {}
        if v.phase is not Phase.RUNNING:
            return "Resources", "stopped with its memory still on the GPU", {}
        # Every gate must pass, so any that refuses is true; the lasting ones are named first (a
        # protection after a start or resume runs out, a higher class does not).
        why = protection(v, snap)
        if why is not None and why[0] != "MinRuntime":
            return why
        if lw is None:
            return "NoPreemption", f"policy {spec.name} never pauses a running job", {}
        lv = spec.running_levels([v], ctx)[0] if spec.running_levels else spec.level(v, ctx)
        if not lw < lv:
            return "Priority", self._level_text(w, v), {}
        if why is not None:
            return why
        holder = self.kept_for.get(v.id)
        if holder is not None and holder != w.id:
            return ("Reserved", f"not paused for it: kept for job {holder}, which holds a reservation on "
                    f"{node}", {})
        cl = self.cl
        plan = park_plan(v, cl.ram_free[node], lambda: cl.spillable_on(node), costs_on(snap, node), snap.config)
        if plan is None:
            return ("NoRoom", "nowhere to park it: the host-RAM park budget is full"
                    + ("" if snap.config.allow_disk and "disk" in v.tiers else " and it cannot go to disk"), {})
        if cl.residue or v.residue_bytes > 0:
            kept_plan = after_park(w, v, plan, cl, snap)
            if kept_plan is None:
                return self._residue_in_way(w, v)
            plan = kept_plan
        cost = plan.per_gpu_s(v)
        if spec.switch_cap and not under_switch_cap(v, cost, snap):
            n = switch_cap_numbers(v, cost, snap)
            return ("SwitchCap",
                    f"would spend {cost:.0f} s parking and resuming it ({plan.tier}), over its "
                    f"{n['cap']:.0%} switching cap: {n['switched_s']:.0f} s of a {n['life_s']:.0f} s life; "
                    f"allowed in {n['allowed_in_s']:.0f} s", n)
        floor = floor_refusal(w, v, ctx.lim) if ctx.lim.active else None
        if floor is not None:
            return "ClassFloor", floor, {"floor_gpus": ctx.lim.floor_gpus}
        if spec.benefit_ok is not None and not spec.benefit_ok(w, v, ctx, cost):
            if spec.name == "gpuswap" and starving(w, ctx) and may_take_by_promotion(w, v, ctx) is False:
                return ("PromotionSpared",
                        f"has waited {ctx.config.las_starvation_factor:g}x its run time itself: a job promoted "
                        "for waiting does not take its GPUs by promotion alone", {})
            gain = service_s(v) - service_s(w)
            factor = snap.config.switch_benefit_factor
            return ("Benefit", f"same class; the gain ({gain:.0f} s less service) is under {factor:g}x the "
                    f"{cost:.0f} s a switch costs", {"gain_s": gain, "switch_s": cost, "factor": factor})
        return "Resources", "could be paused, but that alone would not free enough GPUs on one node", {"switch_s": cost}

    def _residue_in_way(self, w: JobView, v: JobView) -> tuple[str, str, dict[str, float]]:
        """Why pausing `v` would not make room for `w`: memory RAM-parked jobs keep on its GPUs."""
        cl = self.cl
        total = max((cl.mem_total.get(g, 0) for g in v.assigned), default=0)
        others = max((cl.residue.get(g, 0) for g in v.assigned), default=0)
        mem = format_size(w.mem_bytes)
        if not all(cl.fits(g, w) for g in v.assigned):
            text = (f"parked jobs keep {format_size(others)} of its GPU's {format_size(total)}: too little room "
                    f"for this job's {mem} even once it is paused")
        else:
            others += v.residue_bytes
            text = (f"parked in RAM it would keep {format_size(others)} of its GPU's {format_size(total)} "
                    f"(its CUDA context and what it did not attach): too little room for this job's {mem}, "
                    "and it cannot be parked to disk")
        return "Residue", text, {"residue_bytes": float(others), "mem_bytes": float(w.mem_bytes),
                                 "mem_total": float(total)}

    def _level_text(self, w: JobView, v: JobView) -> str:
        """Why `v` ranks too high for `w` to pause it, in the policy's terms."""
        lim = self.ctx.lim           # gpuswap's classes with limits: the classes they are treated at
        cv, cw = class_of(v, lim), class_of(w, lim)
        if cv > cw:
            return (f"{describe(v, lim)}, not preemptible by a lower priority"
                    + (f" (job {w.id} counts as {describe(w, lim)})" if cw != w.priority else ""))
        if cv < cw:
            return f"{label(cv)}; policy {self.spec.name} does not pause it for job {w.id}"
        name, c = self.spec.name, self.ctx
        if name == "gpuswap":
            return (f"same class ({label(class_of(v, lim))}) and attained-service band {gs_band(v, c)}, "
                    f"not above job {w.id}'s {gs_band(w, c)}")
        if name == "las":
            return f"LAS queue {las_queue(v, c)}, not above job {w.id}'s {las_queue(w, c)}"
        if name == "gandiva":
            return "its time slice is not over"
        return f"same priority ({label(v.priority)})"


def _nowhere(w: JobView, nodes: list[str]) -> str:
    """Why no node of the round may take `w` (Cluster.candidate_nodes is empty)."""
    if w.phase is Phase.PAUSED and w.parked == "ram":
        return f"its parked state is on node {w.node}, which has no GPU now"
    disk = w.phase is Phase.PAUSED and w.parked == "disk" and w.disk_nodes
    if disk and not any(n in w.disk_nodes for n in nodes):
        return f"its disk checkpoint is reachable only from {', '.join(w.disk_nodes)}, not in the pool now"
    if disk:
        return (f"its disk checkpoint is reachable from {', '.join(w.disk_nodes)} and its working directory only "
                f"on {', '.join(w.allowed_nodes)}: no node in the pool now has both")
    return f"its working directory can be entered only on {', '.join(w.allowed_nodes)}, which has no GPU now"
