"""Why a job waits, as Slurm-style reason codes (squeue's NODELIST(REASON) column).

One pure function of the job and the node's live jobs, so the dashboard, `gpuswap top` and the
JSON API all say the same thing, and tests can pin it without a daemon.
"""
from __future__ import annotations

from typing import Optional, Sequence

from gpuswap.jobs import JobState
from gpuswap.node.store import JobRecord

REASONS = {
    "JobHeldUser": "paused by its owner; `gpuswap resume` lets it run again",
    "Priority": "jobs of higher priority (or submitted earlier) are ahead of it in the queue",
    "Preempting": "another job is being paused to free GPUs",
    "Resources": "all the GPUs it needs are held by jobs it may not preempt "
                 "(equal or higher priority, within their minimum runtime, or not preemptible)",
    "None": "no reason to wait: it starts at the controller's next tick",
}

def _waiting(j: JobRecord) -> bool:
    return j.state in (JobState.PENDING, JobState.PAUSED) and not j.cancel_requested


def _rank(j: JobRecord) -> tuple[int, float, int]:
    return (-j.priority, j.submit_time, j.id)


def pending_reason(job: JobRecord, live: Sequence[JobRecord], gpu_count: int) -> Optional[str]:
    """The reason code for a waiting (PENDING or PAUSED) job; None for a job that is not waiting."""
    if not _waiting(job):
        return None
    if job.hold:
        return "JobHeldUser"
    held = {g for j in live if j.holds_gpu for g in j.assigned}
    if job.stopped:
        held -= set(job.assigned)          # a SIGSTOPped job holds its own GPUs
    free = gpu_count - len(held)
    if job.parked == "ram" and job.home_gpus:
        fits = not (set(job.home_gpus) & held)   # its CUDA context lives there: only those will do
    else:
        fits = free >= job.gpus
    ahead = [j for j in live if j.id != job.id and _waiting(j) and not j.hold and _rank(j) < _rank(job)]
    if ahead and (not fits or free < job.gpus + sum(j.gpus for j in ahead)):
        return "Priority"
    if fits:
        return "None"
    if any(j.state == JobState.PAUSING for j in live):
        return "Preempting"
    return "Resources"
