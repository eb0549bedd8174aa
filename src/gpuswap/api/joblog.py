"""A job's output, read on the machine that ran it: this one, or its pool node (through its agent)."""
from __future__ import annotations

from typing import Optional

from fastapi import HTTPException

from gpuswap.node.launcher import Launcher
from gpuswap.node.pool import Pool
from gpuswap.node.records import JobRecord


def read_log(pool: Pool, job: JobRecord, offset: Optional[int], size: int) -> bytes:
    """At most `size` bytes from `offset` (None: the last `size`). A pool's job never placed has
    none yet; one whose node does not answer now is a 503 naming the node (its log is there)."""
    if pool.single:
        return pool.node_of(job).read_log(job.id, offset, size)
    if job.node is None:
        return b""
    try:
        return pool.node_of(job).read_log(job.id, offset, size)
    except Exception as e:
        raise HTTPException(503, f"job {job.id}'s output is on node {job.node}, which does not answer now: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None


def log_path(pool: Pool, job: JobRecord, launcher: Launcher) -> str:
    """Where its output is, on its node (for `show`)."""
    if pool.single or job.node is None:
        return str(launcher.log_path(job.id))
    try:
        return pool.node_of(job).log_path(job.id)
    except KeyError:
        return f"{job.node}: (the node is not in the pool now)"
