"""The machines the controller schedules over, each behind one small interface.

A `Node` is what the controller may ask of one machine: its GPUs; to launch a job's generation
under a supervisor (idempotent per generation); to tell a supervisor what is desired; what is (the
supervisor's report with what NVML and /proc add, as `observe.Facts`); a transparent park's next
driver step; a transition's node-local effect. Each call is a fact or an idempotent move, so a
node may answer from another process (node/raypool.py's `RayNode` asks that machine's agent,
node/agent.py) and a call repeated after a failure does no harm.

`LocalNode` is this machine, as the single daemon always ran it; `Pool` is a daemon's nodes and
`Layout` numbers their GPUs for the policy (each node's GPUs after the previous node's, in name
order). A pool of one local node keeps its GPUs' own indices and leaves the jobs' `node` unset,
so a single daemon's records and snapshots are what they were before pools existed.
"""
from __future__ import annotations

import abc
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gpuswap.jobs import JobState
from gpuswap.node import observe, residue, sessions
from gpuswap.node.cuda_ckpt import Capability, CheckpointDriver
from gpuswap.node.freezer import Freezer
from gpuswap.node.gpus import GpuInfo, GpuInventory
from gpuswap.node.launcher import Launcher, Observation, cwd_problem
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import Effect, Transition, perform
from gpuswap.node.transparent import job_cuda_processes
from gpuswap.protocol import rundir
from gpuswap.protocol.rundir import Desired

log = logging.getLogger("gpuswap.pool")

LOCAL = "local"
_GPU_IDS = re.compile(r"(\S+ )?GPU (\d+(?:,\d+)*)\b")     # the one node of a single daemon (policy/model.py's default node name)


class Node(abc.ABC):
    """One machine's half of the daemon, as the controller sees it."""

    name: str

    @abc.abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """Its GPUs now (their `index` is the node's own)."""

    @abc.abstractmethod
    def launch(self, job: JobRecord, env: dict[str, str], generation: int, gpus: Sequence[int],
               desired: Desired) -> None:
        """Start this generation's supervisor unless it was already started."""

    @abc.abstractmethod
    def spawned(self, job_id: int, generation: int) -> bool:
        ...

    @abc.abstractmethod
    def set_desired(self, job_id: int, generation: int, desired: Desired) -> None:
        ...

    @abc.abstractmethod
    def observe(self, job: JobRecord) -> observe.Facts:
        """What its supervisor reports, with the residue or orphans observe.py asks for."""

    @abc.abstractmethod
    def has_cuda_process(self, job: JobRecord) -> bool:
        """Whether the job has a CUDA process now (a freeze could start at once)."""

    @abc.abstractmethod
    def driver_step(self, step: str, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        """The freezer's next move ("freezing" or "thawing") for a transparently parked job, or
        ("undoing") for a running one a freeze given up on may have left held by the driver."""

    @abc.abstractmethod
    def effect(self, job_id: int, effect: Effect) -> None:
        """A transition's node-local effect (node/transition.py): kill a session, drop checkpoints."""

    @abc.abstractmethod
    def cwd_problem(self, cwd: str, uid: int, gid: int) -> Optional[str]:
        """Why the user cannot enter `cwd` on this node (None: they can), by the kernel."""

    @abc.abstractmethod
    def read_log(self, job_id: int, offset: Optional[int], size: int) -> bytes:
        """At most `size` bytes of a job's output from `offset`, or its last `size` bytes with
        offset None (b"" past its end or before it exists)."""

    @abc.abstractmethod
    def log_path(self, job_id: int) -> str:
        """Where a job's output is on this node."""

    @abc.abstractmethod
    def last_checkpoint(self, job_id: int, width: int = 1) -> Optional[tuple[int, int]]:
        """(step, bytes) of the job's newest disk checkpoint this node reaches that a job of
        `width` ranks restores from (node/lastckpt.py), or None."""

    @abc.abstractmethod
    def forget(self, job_id: int) -> bool:
        """Delete a finished job's files on this node; False while a supervisor of it runs."""

    @abc.abstractmethod
    def live_runs(self) -> list[tuple[int, int]]:
        """(job id, generation) of every supervisor alive on this node, whatever the records say."""

    def reap(self) -> None:
        """Collect exited children (a no-op where the node's agent does it)."""


def node_facts(launcher: Launcher, gpus: GpuInventory, job: JobRecord) -> observe.Facts:
    """Read what is, on the job's own machine: its supervisor's status, and what NVML or /proc
    must add (the residue of a RAM park; what is left of a job whose supervisor died)."""
    if not observe.reads_status(job):
        return observe.Facts(None)
    obs = launcher.observe(job.id, job.generation)
    pid = obs.job_pid
    if observe.wants_residue(job, obs):
        return observe.Facts(obs, residue=residue.measure(obs.job_pid, gpus, job.assigned))
    if obs.exit is None and not obs.alive and pid is not None and pid > 1:
        uid = sessions.job_uid(job.uid)
        return observe.Facts(obs, orphans=sessions.alive(pid, obs.job_start_ticks, uid, obs.rank_pids))
    if job.state == JobState.RUNNING and obs.exit is None:
        # One stat per running job, no driver call: only a job whose freeze left its record (a
        # freeze given up on) is asked about (observe.decide -> Freezer.undoing).
        return observe.Facts(obs, freeze_record=(launcher.run_dir(job.id, job.generation) / rundir.TRANSPARENT).exists())
    return observe.Facts(obs)


class LocalNode(Node):
    """This machine: its launcher, its GPUs and its checkpoint driver, called directly."""

    def __init__(self, launcher: Launcher, inventory: GpuInventory, driver: CheckpointDriver, name: str = LOCAL):
        self.name, self.launcher, self.inventory, self.driver = name, launcher, inventory, driver
        self.freezer = Freezer(driver, inventory, launcher.run_dir)

    def gpus(self) -> list[GpuInfo]:
        return self.inventory.list()

    def launch(self, job: JobRecord, env: dict[str, str], generation: int, gpus: Sequence[int],
               desired: Desired) -> None:
        self.launcher.launch(job, env, generation, self.inventory.visible_devices(list(gpus)), desired)

    def spawned(self, job_id: int, generation: int) -> bool:
        return self.launcher.spawned(job_id, generation)

    def set_desired(self, job_id: int, generation: int, desired: Desired) -> None:
        self.launcher.set_desired(job_id, generation, desired)

    def observe(self, job: JobRecord) -> observe.Facts:
        return node_facts(self.launcher, self.inventory, job)

    def has_cuda_process(self, job: JobRecord) -> bool:
        pid = self.launcher.observe(job.id, job.generation).job_pid
        return bool(pid) and bool(job_cuda_processes(pid, self.inventory))

    def driver_step(self, step: str, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        if step not in ("freezing", "thawing", "undoing"):
            raise ValueError(f"no driver step {step!r}")
        return getattr(self.freezer, step)(job, obs, now)

    def effect(self, job_id: int, effect: Effect) -> None:
        perform(effect, self.launcher.ckpt_dir)

    def cwd_problem(self, cwd: str, uid: int, gid: int) -> Optional[str]:
        return cwd_problem(cwd, uid, gid)

    def read_log(self, job_id: int, offset: Optional[int], size: int) -> bytes:
        try:
            with open(self.launcher.log_path(job_id), "rb") as f:
                end = os.fstat(f.fileno()).st_size
                start = max(0, end - size) if offset is None else offset
                if start < end:          # seeking far past the end is EINVAL
                    f.seek(start)
                    return f.read(size)
        except FileNotFoundError:
            pass
        return b""

    def log_path(self, job_id: int) -> str:
        return str(self.launcher.log_path(job_id))

    def live_runs(self) -> list[tuple[int, int]]:
        return self.launcher.live_runs()

    def forget(self, job_id: int) -> bool:
        return self.launcher.forget(job_id)

    def last_checkpoint(self, job_id: int, width: int = 1) -> Optional[tuple[int, int]]:
        return self.launcher.last_checkpoint(job_id, width)

    def reap(self) -> None:
        self.launcher.reap()


@dataclass(frozen=True)
class Layout:
    """The policy's GPU ids: node by node in name order, each node's GPUs after the previous
    node's. Made again every tick from the nodes' GPU lists, so a node that joins adds its GPUs."""
    offsets: dict[str, int] = field(default_factory=dict)      # node -> its first GPU's id
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, gpus: dict[str, list[GpuInfo]]) -> "Layout":
        offsets, counts, at = {}, {}, 0
        for name in sorted(gpus):
            offsets[name], counts[name] = at, len(gpus[name])
            at += len(gpus[name])
        return cls(offsets, counts)

    def to_pool(self, node: str, index: int) -> int:
        return self.offsets[node] + index

    def name_gpus(self, text: str) -> str:
        """A policy sentence with its GPUs named as people see them in a pool: "on node-b GPU 1"
        (the pool's id) -> "on GPU node-b:0" (the node's own index, as `gpuswap gpus` lists it)."""
        def named(m: re.Match) -> str:
            try:
                where = [self.to_node(int(g)) for g in m.group(2).split(",")]
            except KeyError:
                return m.group(0)
            lead = m.group(1) if m.group(1) and m.group(1).strip() != where[0][0] else ""
            return f"{lead}GPU {','.join(f'{n}:{i}' for n, i in where)}"
        return _GPU_IDS.sub(named, text)

    def to_node(self, gpu: int) -> tuple[str, int]:
        for name, first in self.offsets.items():
            if first <= gpu < first + self.counts[name]:
                return name, gpu - first
        raise KeyError(f"no GPU {gpu} in the pool")


class Pool:
    """The nodes one daemon schedules over. `single`: one local node, the classic daemon: its jobs
    carry no node, and the GPU ids the policy sees are the machine's own indices."""

    def __init__(self, nodes: Sequence[Node], capability: Capability, single: bool = False):
        self._nodes = {n.name: n for n in nodes}
        self._capability = capability
        self.single = single
        self.last: dict[str, list[GpuInfo]] = {}     # what gpus() found last (the API lists it)
        self.notify: Callable[[], None] = lambda: None   # something changed off the tick (the controller's wake)

    @property
    def capability(self) -> Capability:
        """What can be parked transparently (`gpuswap gpus` shows it)."""
        return self._capability

    def capability_of(self, node: Optional[str]) -> Capability:
        """The capability where a job on `node` runs (one machine: its own)."""
        return self._capability

    def nodes(self) -> dict[str, Node]:
        return dict(self._nodes)

    def add(self, node: Node) -> None:
        self._nodes[node.name] = node

    def node_of(self, job: JobRecord) -> Node:
        """The node a job runs or is parked on; KeyError if the pool has it not (now)."""
        name = LOCAL if self.single else job.node
        if name is None or name not in self._nodes:
            raise KeyError(f"node {name!r} of job {job.id} is not in the pool now")
        return self._nodes[name]

    def gpus(self) -> dict[str, list[GpuInfo]]:
        """Each node's GPUs. A node that cannot answer now is left out, GPUs and all: nothing is
        placed on them, and its jobs stay out of the snapshot until it answers again. On a single
        daemon a failure is the tick's own (as it always was)."""
        out: dict[str, list[GpuInfo]] = {}
        for name, node in list(self._nodes.items()):
            if self.single:
                out[name] = node.gpus()
                continue
            try:
                out[name] = node.gpus()
            except Exception as e:
                if name in self.last:
                    log.warning("node %s does not answer (%s); its GPUs and jobs wait for it",
                                name, str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
        self.last = out
        return out

    def reap(self) -> None:
        for node in list(self._nodes.values()):
            node.reap()

    def on(self, name: str) -> Node:
        """The node of that name (a single daemon's one node whatever the name); KeyError if absent."""
        key = LOCAL if self.single else name
        if key not in self._nodes:
            raise KeyError(f"node {name} is not in the pool now")
        return self._nodes[key]

    def ram_budget(self, node: Optional[str], default: int) -> int:
        """Host RAM that parked jobs may hold on `node`: the daemon's budget on one machine."""
        return default

    def disk_nodes(self, node: str) -> tuple[str, ...]:
        """The nodes in the pool now that reach a disk checkpoint written on `node` (empty: any,
        one machine). Without storage shared between them, that node alone."""
        return () if self.single else (node,) if node in self._nodes else ()

    def workdirs(self, cwd: str, uid: int, gid: int) -> Optional[dict[str, Optional[str]]]:
        """Node by node, whether user `uid` can enter `cwd` there (None: yes; else why not), as far
        as it is known now (node/workdirs.py); a node not checked yet is absent. None: no limit, one
        machine (where the submission itself checked it)."""
        return None

    def serve_forwarded(self, serve: Callable[[Any, str], Any]) -> None:
        """Answer the API requests made on the nodes' own sockets with `serve(request, node)`
        (node/gateway.py): a pool's nodes have them; one machine has only the daemon's socket."""

    def stop(self) -> None:
        """Stop what the pool runs beside the controller."""

    def lost(self, placed: set[str]) -> dict[str, str]:
        """Of the nodes jobs are `placed` on, those lost for good, each with why: their jobs end
        (controller: observe.node_lost). None on one machine, nor in a pool until its cluster layer says so."""
        return {}


def single(launcher: Launcher, inventory: GpuInventory, driver: CheckpointDriver) -> Pool:
    """The classic daemon: this machine alone."""
    return Pool([LocalNode(launcher, inventory, driver)], driver.capability, single=True)


