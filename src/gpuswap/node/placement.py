"""Where jobs are and may go, as the controller hands them to the policy and takes its decisions back.

The policy numbers GPUs across the pool (node/pool.py's Layout) and is told, per job, where it may
start or resume: the nodes reaching a parked job's disk checkpoint (Pool.disk_nodes) and those where
its user can enter its working directory (node/workdirs.py). `Placement` keeps the layout, each job's
view (made again only when its record, its reach or the layout changes), and maps a decision's GPUs
back to (node, the node's own indices), refusing one that lands where the job cannot be. On one
machine all of it is the identity: no layout, no limits, the machine's own GPU indices.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from gpuswap.jobs import JobState
from gpuswap.node import snapshot, workdirs
from gpuswap.node.cuda_ckpt import Capability
from gpuswap.node.gpus import GpuInfo
from gpuswap.node.pool import Layout, Pool
from gpuswap.node.records import JobRecord
from gpuswap.policy.model import JobView, Resume, Wait


class Placement:
    def __init__(self, pool: Pool):
        self.pool = pool
        self.layout = Layout()
        # job id -> (record version, disk reach, allowed nodes, its view): made again on any change.
        self._views: dict[int, tuple[int, tuple[str, ...], tuple[str, ...], JobView]] = {}
        # In a pool, where each waiting job's working directory may go, from the last tick (replaced
        # whole, so API threads read one consistent dict).
        self.reaches: dict[int, workdirs.Reach] = {}

    def relayout(self, pool_gpus: dict[str, list[GpuInfo]]) -> Layout:
        """The layout of the nodes' GPUs now; the views name GPUs by it, so a new one drops them."""
        layout = Layout.of(pool_gpus)
        if layout != self.layout:
            self._views.clear()
            self.layout = layout
        return layout

    def views(self, schedulable: list[JobRecord]) -> list[JobView]:
        """The policy's views of `schedulable`, less those it must not see now (view())."""
        reaches = {j.id: self._workdir_reach(j) for j in schedulable}
        self.reaches = reaches
        return [v for v in (self._view(j, reaches[j.id]) for j in schedulable) if v is not None]

    def forget(self, job_id: int) -> None:
        self._views.pop(job_id, None)

    def nowhere(self) -> dict[str, Wait]:
        """The waiting jobs no node can take by their working directory, each with why."""
        return {str(i): r.wait for i, r in self.reaches.items() if r.wait is not None and not r.checking}

    def wait_of(self, job: JobRecord, policy_wait: Optional[Wait]) -> Optional[Wait]:
        """Why a waiting job waits: the policy's reason, with the nodes its directory ruled out."""
        reach = self.reaches.get(job.id, workdirs.ANYWHERE)
        if reach.wait is not None:
            return reach.wait
        if policy_wait is not None and reach.note:
            return replace(policy_wait, text=policy_wait.text + reach.note)
        return policy_wait

    def _view(self, job: JobRecord, where: workdirs.Reach) -> Optional[JobView]:
        """The policy's view of a job, its GPUs named by their ids in the pool; None for a job on
        a node that is not in the pool now (out of the snapshot: nothing is placed on its GPUs,
        which are not in it either, until its node answers again), or for a waiting job whose
        working directory no node can enter now (`where`)."""
        if where.wait is not None:
            return None
        reach = self.disk_nodes(job)
        cached = self._views.get(job.id)
        if cached is None or cached[:3] != (job.version, reach, where.nodes):
            if (not self.pool.single and job.node is not None and job.node not in self.layout.offsets
                    and not (on_disk(job) and reach)):      # a disk checkpoint others reach goes on
                return None
            cap = self.cap(job)
            cached = self._views[job.id] = (job.version, reach, where.nodes, snapshot.job_view(
                job, cap.available, cap.migration, None if self.pool.single else self.layout, reach, where.nodes))
        return cached[3]

    def _workdir_reach(self, job: JobRecord) -> workdirs.Reach:
        """In a pool, the nodes where a waiting job may start or resume by its working directory."""
        if self.pool.single or job.state not in (JobState.PENDING, JobState.PAUSED):
            return workdirs.ANYWHERE
        return workdirs.reach(job, self.pool.workdirs(job.cwd, job.uid, job.gid), self.pool.nodes())

    def cap(self, job: JobRecord) -> Capability:
        """The transparent capability where the job runs or is parked: its node's in a pool."""
        return self.pool.capability_of(job.node)

    def disk_nodes(self, job: JobRecord) -> tuple[str, ...]:
        """In a pool, where a parked job's disk checkpoint is (or would be) reachable."""
        if self.pool.single or job.node is None or job.state != JobState.PAUSED or job.parked not in ("ram", "disk"):
            return ()
        return self.pool.disk_nodes(job.node)

    # -- decisions back to nodes ----------------------------------------------------------------
    def placed(self, gpus: tuple[int, ...] | list[int]) -> tuple[Optional[str], list[int]]:
        """The policy's GPU ids as (node, the node's own indices); node None on a single daemon."""
        if self.pool.single:
            return None, list(gpus)
        where = [self.layout.to_node(g) for g in gpus]
        nodes = {n for n, _ in where}
        if len(nodes) != 1:
            raise ValueError(f"GPUs {gpu_list(gpus)} are on {len(nodes)} nodes; a job runs on one")
        return nodes.pop(), [i for _, i in where]

    def where(self, node: Optional[str], gpus: list[int]) -> str:
        """'GPU 0,1', or in a pool 'GPU node-b:0,node-b:1', as `gpuswap gpus` and `ls` name them."""
        return f"GPU {gpu_list(gpus)}" if node is None else "GPU " + ",".join(f"{node}:{g}" for g in gpus)

    def name_gpus(self, text: str) -> str:
        """A policy sentence with its GPUs as people see them (node:index in a pool)."""
        return text if self.pool.single else self.layout.name_gpus(text)

    def may_enter(self, job: JobRecord, gpus: tuple[int, ...]) -> bool:
        """Whether the node of `gpus` is one where the job's working directory can be entered (the
        policy places it so: JobView.allowed_nodes); a start anywhere else is not carried out."""
        allowed = self.reaches.get(job.id, workdirs.ANYWHERE).nodes
        return self.pool.single or not allowed or self.placed(gpus)[0] in allowed

    def on_its_node(self, job: JobRecord, d: Resume) -> bool:
        """Whether a resume is where the job's parked state is: its node (RAM; a checkpoint on its
        node's own disk), or any node reaching its disk checkpoint (shared storage, docs/ray.md).
        The policy places it so (JobView.disk_nodes); anything else is not carried out."""
        if self.pool.single or job.node is None:
            return True
        target = self.placed(d.gpus)[0]
        return target == job.node or (on_disk(job) and target in self.pool.disk_nodes(job.node))


def on_disk(job: JobRecord) -> bool:
    return job.state == JobState.PAUSED and job.parked == "disk"


def gpu_list(gpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(g) for g in gpus)
