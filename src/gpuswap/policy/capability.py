"""Which jobs can be parked, how, and at what cost: the one place the daemon and the simulator ask.

The daemon (node/snapshot.py, node/freezer.py) and the simulator (sim/engine.py) both describe a
job by the same few facts -- its width (ranks: processes that each hold a share of its GPU state),
what kind of runtime parks it, its framework, whether this node can park through the CUDA driver,
and why its runtime cannot park to RAM if it said so -- and take the mechanism, the tiers and the
seconds from here, so a rule cannot differ between the published tables and the product.
Pure: no I/O, no clock (docs/design/multi-rank.md §7, §10).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from gpuswap.policy.model import SwitchCosts

COOPERATIVE, TRANSPARENT, NONE = "cooperative", "transparent", "none"
BOTH = frozenset({"ram", "disk"})
RAM_ONLY = frozenset({"ram"})
DISK_ONLY = frozenset({"disk"})
NO_TIERS: frozenset[str] = frozenset()

# How the job's GPU state can be reached:
#   cooperative   a gpuswap runtime parks it (it attached, or the job was submitted
#                 --pause-mode cooperative)
#   auto          no runtime has attached yet (the default mode): the CUDA driver parks it where
#                 this node can, else its runtime once it attaches
#   none          no runtime will: --pause-mode transparent, or no runtime attached before a pause
#                 timed out (the daemon's --no-runtime fallback); only the driver can park it
#   unresponsive  its runtime attached but did not answer a pause in time: not paused again
RuntimeKind = Literal["cooperative", "auto", "none", "unresponsive"]
RUNTIME_KINDS: tuple[str, ...] = ("cooperative", "auto", "none", "unresponsive")

# cuda-checkpoint "does not support UVM or IPC memory" (NVIDIA/cuda-checkpoint README,
# "Functionality"), and NCCL between the processes of one node exchanges data through CUDA IPC
# buffers: a driver checkpoint of one rank would lose what its peers map. docs/transparent.md.
NCCL_TRANSPARENT_REFUSAL = ("transparent parking of multi-process NCCL jobs is not supported "
                            "(cuda-checkpoint does not checkpoint CUDA IPC memory)")
TRANSPARENT_RAM_ONLY = ("parked through the CUDA driver: host RAM only (a disk park would need "
                        "CRIU, which gpuswap does not drive)")
UNRESPONSIVE = "its gpuswap runtime did not answer a pause in time; it is not paused again"
NO_MECHANISM = "no gpuswap runtime, and this node cannot park jobs through the CUDA driver"
MULTI_RANK_OFF = "multi-GPU (multi-rank) jobs are not preemptible in this setting (--multi-rank none)"

# Frameworks whose process groups the runtime cannot rebuild in place (design §3): a RAM park,
# which keeps the processes, would leave groups bound to destroyed communicators.
_NO_RAM_PARK = {"fsdp1": "FSDP1 keeps its process groups in internal state gpuswap cannot rebind"}


@dataclass(frozen=True, slots=True)
class Parkability:
    mechanism: str                  # "cooperative" | "transparent" | "none"
    tiers: frozenset[str]           # what it can be parked to now
    why_not: Optional[str] = None   # when tiers is empty or narrowed: a sentence for ls/show/reasons


def transparent_allowed(width: int, transparent_ok: bool) -> bool:
    """The driver path parks a job only when this node can use it and the job's GPU work is in
    one CUDA process: more than one process of one group talk through CUDA IPC (above)."""
    return transparent_ok and width <= 1


def parkability(width: int, runtime: RuntimeKind, framework: Optional[str] = None,
                transparent_ok: bool = False, ram_refusal: Optional[str] = None, *,
                transparent_refused: Optional[str] = None, multi_rank: bool = True) -> Parkability:
    """How this job can be parked now.

    `width`: its ranks (CUDA processes of one group; 1 for a single-process job);
    `transparent_ok`: this node can park through the driver and has not refused this job
    (`transparent_refused` says why it did); `ram_refusal`: why its runtime cannot rebuild its
    group, so a RAM park becomes a disk park; `multi_rank=False` models gpuswap before multi-rank
    support (multi-GPU jobs not preemptible), for the simulator's comparison tables.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if runtime not in RUNTIME_KINDS:
        raise ValueError(f"unknown runtime kind {runtime!r}; one of {', '.join(RUNTIME_KINDS)}")
    if width > 1 and not multi_rank:
        return Parkability(NONE, NO_TIERS, MULTI_RANK_OFF)
    if runtime == "unresponsive":
        return Parkability(NONE, NO_TIERS, UNRESPONSIVE)
    driver = transparent_allowed(width, transparent_ok)
    if runtime == "cooperative" or (runtime == "auto" and not driver):
        refusal = ram_refusal or _NO_RAM_PARK.get((framework or "").lower())
        if refusal:
            return Parkability(COOPERATIVE, DISK_ONLY, f"no RAM park: {refusal}; parks to disk")
        if runtime == "auto" and width > 1 and transparent_ok:
            # Parked by its runtime once every rank attached; never by the driver.
            return Parkability(COOPERATIVE, BOTH, NCCL_TRANSPARENT_REFUSAL)
        return Parkability(COOPERATIVE, BOTH)
    if driver:                                   # auto or none, one process
        return Parkability(TRANSPARENT, RAM_ONLY, TRANSPARENT_RAM_ONLY)
    if width > 1 and transparent_ok:
        return Parkability(NONE, NO_TIERS, NCCL_TRANSPARENT_REFUSAL)
    return Parkability(NONE, NO_TIERS, transparent_refused or NO_MECHANISM)


# -- cost ------------------------------------------------------------------------------------
# A park of a width-w job: the ranks copy in parallel, each over its own GPU's link, so it takes
# the slowest rank's copy -- unless the host's memory system, shared by all copies, is the
# narrower pipe: the aggregate rate is min(w x per-link, host). Plus the group's fixed cost: its
# communicators are destroyed before the copy-out and created again after the copy-in (design §3).
# Disk: every rank writes (reads) its part to (from) one filesystem at once, so the filesystem's
# bandwidth is shared: sum(bytes) / disk bandwidth; a disk restart creates the group again too.
# Width 1 is SwitchCosts' single-process arithmetic, unchanged to the bit.

def _copy_s(per_rank_bytes: Sequence[int], per_link_bps: float, host_bps: float) -> float:
    return max(max(per_rank_bytes) / per_link_bps, sum(per_rank_bytes) / host_bps)


def multi_rank_park_s(costs: SwitchCosts, per_rank_bytes: Sequence[int], tier: str) -> float:
    """Seconds of one park of a job whose ranks hold `per_rank_bytes` each (rank order)."""
    if len(per_rank_bytes) <= 1:
        return costs.park_s(sum(per_rank_bytes), tier)
    if tier == "ram":
        return (costs.ram_fixed_s + costs.group_teardown_s
                + _copy_s(per_rank_bytes, costs.ram_park_bps, costs.host_copy_bps))
    return costs.ram_fixed_s + sum(per_rank_bytes) / costs.disk_write_bps


def multi_rank_resume_s(costs: SwitchCosts, per_rank_bytes: Sequence[int], tier: str) -> float:
    """Seconds of one resume (RAM) or restart (disk) of such a job, its group created again."""
    if len(per_rank_bytes) <= 1:
        return costs.resume_s(sum(per_rank_bytes), tier)
    if tier == "ram":
        return (costs.ram_fixed_s + costs.group_rebuild_s
                + _copy_s(per_rank_bytes, costs.ram_resume_bps, costs.host_copy_bps))
    return costs.disk_fixed_s + costs.group_rebuild_s + sum(per_rank_bytes) / costs.disk_read_bps


def _split(nbytes: int, width: int) -> list[int]:
    """A job's bytes spread evenly over its ranks (data parallel: each holds the same share)."""
    share, rest = divmod(nbytes, width)
    return [share + (1 if r < rest else 0) for r in range(width)]


def park_s(costs: SwitchCosts, nbytes: int, tier: str, width: int = 1) -> float:
    """Seconds of one park of `nbytes` held by `width` ranks in equal shares."""
    if width <= 1:
        return costs.park_s(nbytes, tier)
    return multi_rank_park_s(costs, _split(nbytes, width), tier)


def resume_s(costs: SwitchCosts, nbytes: int, tier: str, width: int = 1) -> float:
    """Seconds of one resume of `nbytes` held by `width` ranks in equal shares."""
    if width <= 1:
        return costs.resume_s(nbytes, tier)
    return multi_rank_resume_s(costs, _split(nbytes, width), tier)
