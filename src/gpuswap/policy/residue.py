"""What a cooperative RAM park leaves on the GPU (its `residue`), kept reserved (issue 12, bug 5).

A job parked in RAM by its runtime frees its attached tensors and the allocator's cache, not its
CUDA context, library workspaces, graph pools or tensors it did not attach: NVML still lists its
process with that memory, and the daemon measures it (`JobView.residue_bytes`). Until the job
resumes or leaves RAM, that memory is taken on each of its home GPUs. Three rules, for every policy:

* Placement: a job whose known footprint (`mem_bytes`) does not fit beside the residue on a free
  GPU is not placed there (`ClusterState.fits`; a job of unknown footprint, 0, is assumed to fit,
  as it is on every GPU: the policy cannot know better). A RAM-parked job's own resume counts the
  residue of others on its home GPUs; its own is part of its footprint.
* Preemption: parking a victim to RAM leaves its residue on the GPUs it frees. If the preemptor
  does not fit beside it, the victim is parked to disk instead (the process exits, taking the
  residue with it) if it can be, else that victim is not taken (`after_park`).
* Clearing: a waiting job that fits on free GPUs only once a RAM-parked job's residue is gone may
  have that job spilled to disk, under the rules that would let it pause the job were it running
  (a strictly lower preemption level, the switch cap and benefit gates at the spill's cost:
  `victims.may_spill_for`); the GPUs are reserved for it meanwhile (`clearing`).

The simulator's jobs have no residue, so none of this changes its decisions.
"""
from __future__ import annotations

from typing import Callable, Optional

from gpuswap.jobs import format_size
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.costs import ParkPlan, costs_of, disk_plan
from gpuswap.policy.model import JobView, Snapshot


def after_park(w: JobView, v: JobView, plan: ParkPlan, cl: ClusterState, snap: Snapshot) -> Optional[ParkPlan]:
    """`plan` for victim `v`, unless it parks `v` to RAM and `w` would not fit beside the residue
    that leaves on the GPUs `v` frees: then parking to disk (the process exits, its residue with
    it), or None when it cannot go there, or when others' residue on those GPUs is in the way anyway."""
    if w.mem_bytes <= 0:
        return plan
    if not all(cl.fits(g, w) for g in v.assigned):
        return None
    if plan.tier != "ram" or v.residue_bytes <= 0 or all(cl.fits(g, w, v.residue_bytes) for g in v.assigned):
        return plan
    return disk_plan(v, costs_of(snap, v), snap.config)


def clearing(w: JobView, nodes: list[str], need: int, cl: ClusterState, may_spill: Callable[[JobView], bool],
             order: Callable[[JobView], tuple], exact: Optional[set[int]] = None
             ) -> Optional[tuple[str, list[int], list[JobView]]]:
    """Free GPUs for `w` made usable by spilling RAM-parked jobs whose residue is in its way:
    (node, the `need` GPUs, the jobs to spill), with the fewest spills (then the node name), or
    None. `exact`: exactly these GPUs (a job pinned to its home GPUs). `order`: the policy's order
    key; the least deserving holders are spilled first."""
    best: Optional[tuple[tuple, str, list[int], list[JobView]]] = None
    for node in nodes:
        free = cl.free[node] if exact is None else [g for g in cl.free[node] if g in exact]
        if len(free) < need or (exact is not None and len(free) != len(exact)):
            continue
        gpus = [g for g in free if cl.fits(g, w)]
        spills: list[JobView] = []
        for g in free:
            if len(gpus) >= need:
                break
            if g in gpus:
                continue
            more = _to_spill(w, g, cl, may_spill, order, spills)
            if more is not None:
                gpus.append(g)
                spills += more
        if len(gpus) >= need and spills:
            key = (len(spills), node)
            if best is None or key < best[0]:
                best = (key, node, sorted(gpus[:need]), spills)
    return None if best is None else best[1:]


def _to_spill(w: JobView, g: int, cl: ClusterState, may_spill: Callable[[JobView], bool],
              order: Callable[[JobView], tuple], already: list[JobView]) -> Optional[list[JobView]]:
    """The residue holders on `g` to spill (least deserving first) until `w` fits there, or None."""
    gone = sum(p.residue_bytes for p in already if g in p.home_gpus)
    out: list[JobView] = []
    taken = {p.id for p in already}
    holders = sorted((p for p in cl.residue_of.get(g, ()) if p.id != w.id and p.id not in taken),
                     key=order, reverse=True)
    for p in holders:
        if cl.fits(g, w, -gone):
            break
        if may_spill(p):
            out.append(p)
            gone += p.residue_bytes
    return out if cl.fits(g, w, -gone) else None


def kept_text(w: JobView, g: int, cl: ClusterState) -> tuple[str, dict[str, float]]:
    """Who keeps what on free GPU `g` that `w` does not fit beside, and the numbers."""
    holders = [p for p in cl.residue_of.get(g, ()) if p.id != w.id]
    kept = cl.residue.get(g, 0) - (w.residue_bytes if g in w.home_gpus else 0)
    who = ", ".join(f"job {p.id}" for p in holders)
    outside = kept - sum(p.residue_bytes for p in holders)
    if outside > 0:
        who = (who + " and " if who else "") + "jobs paused by their users"
    total = cl.mem_total.get(g, 0)
    text = (f"free, but {who or 'parked jobs'} (parked in RAM) keep{'s' if len(holders) == 1 and outside <= 0 else ''} "
            f"{format_size(kept)} on it, and this job needs {format_size(w.mem_bytes)} of its {format_size(total)}")
    return text, {"residue_bytes": float(kept), "mem_bytes": float(w.mem_bytes), "mem_total": float(total)}
