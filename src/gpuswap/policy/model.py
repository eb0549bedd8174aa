"""The policy's world: an immutable snapshot in, a list of decisions out.

Everything here is plain data. The daemon builds a Snapshot from SQLite and the supervisors'
reports; the simulator builds one from its event queue. Both hand it to `policy.decide` and carry
out the decisions they get back, so a scheduling rule lives in exactly one place.
All times are seconds on the caller's clock (`Snapshot.now`); the policy never reads a clock.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union


class Phase(str, enum.Enum):
    """A live job's phase as the policy sees it (terminal jobs are not in a snapshot)."""

    PENDING = "PENDING"      # never started, or requeued after a disk park with no state: waits for GPUs
    RUNNING = "RUNNING"      # holds its GPUs and computes
    PAUSING = "PAUSING"      # asked to park; still holds its GPUs until it reports parked
    PAUSED = "PAUSED"        # parked (see JobView.parked); holds no GPU unless `holds_gpu_while_paused`
    RESUMING = "RESUMING"    # given GPUs again, restoring; holds them


@dataclass(frozen=True, slots=True)
class GpuView:
    id: int                  # index unique in the snapshot (daemon: the node's GPU index)
    node: str = "local"
    mem_total: int = 0       # bytes
    healthy: bool = True
    # Memory on it that no job of the snapshot accounts for but that stays taken: what RAM-parked
    # jobs left out of the snapshot (held by their users) keep there (see JobView.residue_bytes).
    residue_bytes: int = 0


@dataclass(frozen=True, slots=True)
class JobView:
    id: str
    user: str
    priority: int            # gpuswap.jobs.Priority value; higher wins
    phase: Phase
    gpus: int                # GPUs requested
    mem_bytes: int           # GPU memory footprint per GPU (reported by its runtime, else declared)
    submit_time: float
    phase_since: float       # when the job entered its current phase
    last_start: Optional[float] = None   # last start or resume; anchors its protection
    attained_gpu_s: float = 0.0          # GPU-seconds of service received so far (LAS)
    switch_s: float = 0.0                # seconds spent pausing/resuming so far (anti-thrashing)
    run_s: float = 0.0                   # seconds spent RUNNING so far
    assigned: tuple[int, ...] = ()       # GPU ids it holds now
    parked: Optional[str] = None         # "ram" | "disk" | None
    parked_bytes: int = 0
    preemptible: bool = True             # False for --no-preempt
    tiers: frozenset[str] = frozenset({"ram", "disk"})  # tiers this job can be parked to now
    holds_gpu_while_paused: bool = False  # SIGSTOP fallback: paused but its memory stays on the GPU
    node: Optional[str] = None           # node holding its parked RAM state, if any
    weight: float = 1.0                  # the user's fair-share weight
    remaining_s: Optional[float] = None  # known only to the simulator's srtf oracle
    # A RAM-parked cooperative job keeps its CUDA context on the GPUs it ran on, so it can only
    # resume there: Resume(gpus) for a job with home_gpus must name exactly these GPUs.
    home_gpus: tuple[int, ...] = ()
    # What a cooperative RAM park leaves on each of the job's GPUs (CUDA context, library
    # workspaces, tensors it did not attach), as NVML measured at its last such park; 0 before
    # one (unknown: docs/policies.md). A RAM-parked job keeps it on each of its home_gpus; for a
    # running job it is what parking it to RAM would leave for the job that takes its GPUs.
    residue_bytes: int = 0
    # Ranks: processes that each hold a share of its GPU state and park in parallel (equal to
    # `gpus` for a data-parallel job with one rank per GPU; 1 for a single-process job, whatever
    # its GPUs). Its park costs what policy/capability.py says for that width.
    width: int = 1
    # Why `tiers` is empty or narrowed (capability.Parkability.why_not), for the reasons people read.
    why_not: Optional[str] = None
    # Policy pauses (preemptions) it has had, whose parks and resumes `switch_s` sums: with it,
    # switch_s / switches is what a switch of this job has really cost (reaching its safepoint
    # included), which its protection after a resume follows (victims.protected_s). 0: not known.
    switches: int = 0
    # Run-seconds the whole job is expected to need (policy/estimate.py: the user's --time, else the
    # median of its family's recent finished runs), or None. gpuswap ranks by the time it leaves
    # (estimate - run_s) while that is > 0; a job without one, or past it, is ranked by its service.
    estimate_s: Optional[float] = None
    # In a pool: the nodes a disk checkpoint of this job reaches (its node alone, or those sharing
    # its storage, docs/ray.md). Parked to disk it resumes only there, and a RAM-parked job is
    # spilled to move only there. Empty: every node (one machine, and the simulator).
    disk_nodes: tuple[str, ...] = ()
    # In a pool: the nodes where it may start or resume at all, those where its user can enter its
    # working directory (node/workdirs.py; a RAM-parked job's own node always). Empty: every node.
    allowed_nodes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SwitchCosts:
    """Measured (daemon) or modelled (simulator) costs of moving a job's state."""

    ram_park_bps: float = 20e9       # GPU -> pinned host RAM
    ram_resume_bps: float = 20e9     # host RAM -> GPU
    disk_write_bps: float = 1.0e9    # checkpoint write
    disk_read_bps: float = 2.0e9     # checkpoint read at restart
    ram_fixed_s: float = 0.5         # per park or resume, regardless of size (reaching a safepoint, sync)
    disk_fixed_s: float = 10.0       # process restart + framework start-up after a disk park
    # Multi-rank jobs only (policy/capability.py). Orders of magnitude, NOT measured here (no
    # multi-GPU machine was available): destroying the process group's communicators before a RAM
    # park, creating them again after a resume or restart (NCCL, 8 ranks on one node: seconds), and
    # the host memory bandwidth all ranks' copies share (8 PCIe 4 x16 links behind ~4 switches).
    group_teardown_s: float = 1.0
    group_rebuild_s: float = 5.0
    host_copy_bps: float = 100e9

    def park_s(self, nbytes: int, tier: str) -> float:
        if tier == "ram":
            return self.ram_fixed_s + nbytes / self.ram_park_bps
        return self.ram_fixed_s + nbytes / self.disk_write_bps

    def resume_s(self, nbytes: int, tier: str) -> float:
        if tier == "ram":
            return self.ram_fixed_s + nbytes / self.ram_resume_bps
        return self.disk_fixed_s + nbytes / self.disk_read_bps


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    min_runtime_s: float = 5.0           # the floor of the protection after a start/resume (see below)
    max_switch_fraction: float = 0.2     # cap on switch time / lifetime before a job is protected
    fair_share_half_life_s: float = 7 * 24 * 3600.0
    las_thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0)
    las_starvation_factor: float = 2.0   # Tiresias' STARVELIMIT: promote after waiting this x service
    gandiva_quantum_s: float = 600.0
    allow_disk: bool = True
    # Added with the policy core (issue 4); defaults keep older callers valid.
    switch_benefit_factor: float = 2.0   # gpuswap: switch within a class only if benefit >= this x cost
    # gpuswap's LAS bands: attained service per GPU (GPU-seconds / GPUs) doubling from 15 minutes to
    # 256 hours. Finer than Tiresias' 2-3 queues because a park costs seconds, not a
    # checkpoint-restart; per GPU because GPU-seconds starved wide long jobs (policies.md).
    gpuswap_bands_s: tuple[float, ...] = tuple(900.0 * 2**k for k in range(11))
    # Issue 15 item 1, cost-aware protection (every preemptive policy): after a start or resume a
    # job is not paused for protect_multiple x what one switch of it costs (park + resume at the
    # tier it would be parked to; its own measured mean once it has switched), at least
    # min_runtime_s (the floor, above) and at most protect_cap_s (unless the floor is higher).
    # 4 = (1 - 0.2) / 0.2: even a job paused as soon as its protection ends spends at most a fifth
    # of its time switching, the max_switch_fraction default; the cap is the fixed 60 s every job
    # had before, so no job is protected longer than it was. protect_multiple 0 gives the old
    # fixed minimum runtime (min_runtime_s for every job). docs/policies.md has the figures.
    protect_multiple: float = 4.0
    protect_cap_s: float = 60.0
    # Issue 15, item 2 (no starvation of wide jobs): a waiting job that has waited this long in its
    # current phase without being placed gets a reservation on the node that can free its GPUs
    # soonest; jobs behind it may no longer start, resume or preempt there in a way that delays it
    # (reservation.py, docs/policies.md). None: never. Only policies whose Spec has
    # `reserves` (gpuswap). Default: docs/policies.md says why.
    reserve_after_s: Optional[float] = 600.0
    # Issue 15 item 5, classes with limits (policy/classes.py, docs/policies.md); gpuswap only.
    # A user's jobs of class urgent (or high) are treated one class down once the user's decayed
    # GPU-hours in that class (Snapshot.class_usage, half-life class_half_life_s) pass the budget:
    # 192 GPU-h with a 1-day half-life is 8 GPUs for a whole day of deadline work, or about 5.5
    # GPUs used at urgent forever; inf: no budget. Each class below the highest present is
    # guaranteed class_floor_share of the healthy GPUs (rounded down: 2 GPUs of an 8-GPU server)
    # against the others; 0: no floor. Both off (inf, 0) is strict classes.
    class_budget_gpu_h: float = 192.0
    class_half_life_s: float = 24 * 3600.0
    class_floor_share: float = 0.25
    # gpuswap: a job promoted for starving (waited las_starvation_factor x its run time in its
    # current wait) does not pause by promotion alone a job that has itself waited that factor x its
    # run time over its life (gpuswap.may_take_by_promotion): that only moved the starving back
    # and forth (5 preemptions per job on a deep queue). False: the old rule.
    promotion_spares_starved: bool = True


@dataclass(frozen=True, slots=True)
class Snapshot:
    now: float
    gpus: tuple[GpuView, ...]
    jobs: tuple[JobView, ...]        # live jobs only, any order
    costs: SwitchCosts = field(default_factory=SwitchCosts)
    config: PolicyConfig = field(default_factory=PolicyConfig)
    ram_budget: Mapping[str, int] = field(default_factory=dict)   # node -> bytes allowed parked in RAM
    usage: Mapping[str, float] = field(default_factory=dict)      # user -> decayed GPU-seconds
    # (user, class) -> decayed GPU-seconds in jobs of that class, for the urgent and high classes
    # (policy/classes.py; half-life config.class_half_life_s; kept like `usage` by the caller).
    class_usage: Mapping[tuple[str, int], float] = field(default_factory=dict)
    # A pool's nodes each move state at their own speed (docs/ray.md): node -> that node's costs,
    # which price the park, resume and spill of a job on it (`costs.costs_on`). A node not in it,
    # and every job when it is empty (one machine, the simulator), is priced with `costs`.
    node_costs: Mapping[str, SwitchCosts] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    gpus: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Pause:
    job_id: str
    tier: str                        # "ram" | "disk"
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Resume:
    job_id: str
    gpus: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Spill:
    """Move an already RAM-parked job to disk (to make room in the host-RAM budget)."""

    job_id: str
    reason: str = ""


Decision = Union[Start, Pause, Resume, Spill]


@dataclass(frozen=True, slots=True)
class Blocker:
    """One job holding GPUs a waiting job needs, and the rule that keeps it there."""

    job_id: str
    gpus: tuple[int, ...]
    code: str                        # e.g. "SwitchCap", "MinRuntime", "NoPreempt", "Priority"
    text: str                        # "would spend 31 s parking job 4, over its 20% switching cap"
    numbers: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Wait:
    """Why a schedulable job got no GPU from this round, from the round's own reasoning (`explain`).

    `code` is the rule that holds it (the first blocker's, or the round's own, e.g. "Preempting"),
    `text` a sentence with its numbers, `blockers` every holder of a GPU it needs and why."""

    job_id: str
    code: str
    text: str
    numbers: Mapping[str, float] = field(default_factory=dict)
    blockers: tuple[Blocker, ...] = ()

