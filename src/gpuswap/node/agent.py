"""A pool node's agent: the node-local half of the daemon, on one node of a Ray cluster.

node/raypool.py runs it there as a Ray actor (pinned to the node, detached, restarted by Ray when
it dies); the head's controller asks it through `RayNode`, with the calls of node/pool.py's `Node`.
It decides nothing: it lists its GPUs, starts supervisors, writes what the head desires into their
run directories, and returns facts. Everything it knows is on its node's disk (the run directories,
the supervisors' locks and status files), so an agent restarted by Ray, or asked by a restarted
head, answers as the one before it: re-adopting a node's jobs needs no step of its own.

Its node's own settings come from the environment of that node's `ray start` (protocol/env.py):
its state directory, simulated GPUs where there are none, its name in the pool. This module does
not import Ray: the agent is plain code that Ray hosts.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import psutil

from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.cuda_ckpt import Capability, UnavailableDriver
from gpuswap.node.drivers import checkpoint_driver
from gpuswap.node.gateway import Gateway
from gpuswap.node.gpus import GpuInfo, GpuInventory, detect
from gpuswap.node.homedir import prepare
from gpuswap.node.launcher import Launcher, Observation
from gpuswap.node.pool import LocalNode
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import Effect, Transition
from gpuswap.protocol import env as envvars
from gpuswap.protocol.forwarded import ForwardedRequest, ForwardedResponse
from gpuswap.protocol.rundir import Desired

DEFAULT_HOME = "/var/lib/gpuswap/node"
log = logging.getLogger("gpuswap.agent")


class NoGpus(GpuInventory):
    """A node of the pool with no GPU (NVML finds none): it lists none, and says why."""

    def __init__(self, why: str):
        self.why = why

    def list(self) -> list[GpuInfo]:
        return []

    def describe(self) -> str:
        return f"no GPU ({self.why.split(';')[0]})"


STORAGE_MARK = ".gpuswap-storage"
MACHINE_MARK = "machine-id"


def machine_id(home: Path) -> str:
    """This node's own identity, kept in its state directory: the same machine under a new Ray
    node id (its Ray started again) is known for what it is, and another machine of the same name
    is not taken for it."""
    return _mark(home, MACHINE_MARK)


def shared_storage_id(root: Path) -> str:
    """The identity of a shared checkpoint directory: a random id the first agent to use it wrote
    there (linked into place, so it is whole or absent), which every node mounting the same
    storage reads back. Two nodes with the same path but different storage get different ids.
    Refused unless root owns it (a user who did could plant another user's checkpoint in it)."""
    root.mkdir(parents=True, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{root} is not a directory that gpuswap's user (uid {os.geteuid()}) owns")
    os.chmod(root, 0o711)            # each job's directory in it is its owner's, 0700
    return _mark(root, STORAGE_MARK)


def _mark(root: Path, name: str) -> str:
    """A random 32-hex-digit id written once in `root/name` (linked into place) and read back."""
    mark = root / name
    if not mark.exists():
        tmp = root / f"{name}.{os.getpid()}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, uuid.uuid4().hex.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, mark)       # fails if another node linked its own first: theirs stands
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    text = mark.read_text().strip()
    if len(text) != 32 or not all(c in "0123456789abcdef" for c in text):
        raise OSError(f"{mark} is not gpuswap's (expected a 32-hex-digit id)")
    return text


class AgentError(Exception):
    """Why this node's agent cannot serve (one line; the head shows it for the node)."""


class NodeAgent:
    def __init__(self, pause_timeout_s: float, environ: Optional[dict[str, str]] = None):
        env = dict(os.environ if environ is None else environ)
        self.home = Path(env.get(envvars.AGENT_HOME) or DEFAULT_HOME)
        self.name = env.get(envvars.NODE_NAME) or socket.gethostname()
        prepare(self.home)
        # One agent per state directory: a second one (two Ray nodes given the same directory)
        # would launch each job twice. The lock goes with the process, so Ray's restart takes it.
        self._lock = os.open(self.home / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AgentError(f"another gpuswap agent already serves {self.home}") from None
        try:
            gpus: GpuInventory = detect(env.get(envvars.AGENT_SIMULATE_GPUS))
            driver = checkpoint_driver(self.home, gpus)
        except RuntimeError as e:        # a node without GPUs (a CPU-only head): in the pool, with none
            gpus = NoGpus(str(e))
            driver = UnavailableDriver(Capability(False, "this node has no GPU"))
        # Disk checkpoints on storage every node mounts (docs/ray.md): a job parked to disk here
        # may resume on any node whose agent found the same storage (the same `shared_id`).
        self.shared_ckpt: Optional[Path] = None
        self.shared_id: Optional[str] = None
        if env.get(envvars.AGENT_SHARED_CKPT):
            self.shared_ckpt = Path(env[envvars.AGENT_SHARED_CKPT])
            try:
                self.shared_id = shared_storage_id(self.shared_ckpt)
            except OSError as e:
                raise AgentError(f"cannot use {self.shared_ckpt} ({envvars.AGENT_SHARED_CKPT}) for checkpoints: "
                                 f"{e.strerror or e}") from None
        launcher = Launcher(self.home, simulated=gpus.simulated, pause_timeout_s=pause_timeout_s, detach=True,
                            ckpt_root=self.shared_ckpt)
        self.local = LocalNode(launcher, gpus, driver, name=self.name)
        try:
            self.machine = machine_id(self.home)
        except OSError as e:
            raise AgentError(f"cannot read or write {self.home / MACHINE_MARK}: {e.strerror or e}") from None
        # This node's switch-cost calibration: made once the head first asks (calibration()).
        self._calibration_lock = threading.Lock()
        self._calibrating: Optional[threading.Thread] = None
        self._calibrated: Optional[dict[str, dict[str, object]]] = None
        # `gpuswap` on this node: its API socket, whose requests the head takes and answers.
        self.gateway = Gateway(self.home / "gpuswap.sock")
        try:
            self.gateway.start()
        except OSError as e:
            raise AgentError(f"cannot serve {self.gateway.path}: {e.strerror or e}") from None

    def info(self) -> dict[str, Any]:
        """Who this agent is: the head names the node by it and shows the rest."""
        cap = self.local.driver.capability
        return {"name": self.name, "home": str(self.home), "pid": os.getpid(),
                "describe": self.local.inventory.describe(), "simulated": self.local.inventory.simulated,
                "transparent": cap.available, "transparent_reason": cap.reason,
                "shared_ckpt": str(self.shared_ckpt) if self.shared_ckpt else None, "shared_id": self.shared_id,
                "ram_total": psutil.virtual_memory().total, "capability": cap, "machine": self.machine}

    def calibration(self) -> Optional[dict[str, dict[str, object]]]:
        """This node's switch-cost figures as the single daemon calibrates its machine at start
        (node/bandwidth.py: disk write and read in this agent's home; the RAM tier by pinned copies
        on a real GPU, a host memcpy on simulated ones), each with its source; None while they are
        made. The first call starts them on a thread of their own and answers at once, so neither
        the agent's start nor the head's calls wait for a second of disk I/O; a head that runs with
        `--no-calibrate` never asks, and nothing is measured."""
        with self._calibration_lock:
            if self._calibrating is None:
                self._calibrating = threading.Thread(target=self._calibrate, name="calibrate", daemon=True)
                self._calibrating.start()
            return self._calibrated

    def _calibrate(self) -> None:
        figures = Bandwidths()
        try:
            figures.calibrate(self.home, self.local.inventory.simulated)
        except Exception:          # what was measured before the failure still counts
            log.exception("calibrating this node's switch costs failed")
        with self._calibration_lock:
            self._calibrated = figures.calibrated()

    def gpus(self) -> list[GpuInfo]:
        return self.local.gpus()

    def launch(self, job: JobRecord, env: dict[str, str], generation: int, gpus: Sequence[int],
               desired: Desired) -> None:
        self.local.launch(job, env, generation, gpus, desired)

    def spawned(self, job_id: int, generation: int) -> bool:
        return self.local.spawned(job_id, generation)

    def set_desired(self, job_id: int, generation: int, desired: Desired) -> None:
        self.local.set_desired(job_id, generation, desired)

    def observe(self, job: JobRecord) -> observe.Facts:
        return self.local.observe(job)

    def has_cuda_process(self, job: JobRecord) -> bool:
        return self.local.has_cuda_process(job)

    def driver_step(self, step: str, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        return self.local.driver_step(step, job, obs, now)

    def effect(self, job_id: int, effect: Effect) -> None:
        self.local.effect(job_id, effect)

    def live_runs(self) -> list[tuple[int, int]]:
        return self.local.live_runs()

    def last_checkpoint(self, job_id: int, width: int = 1) -> Optional[tuple[int, int]]:
        return self.local.last_checkpoint(job_id, width)

    def forget(self, job_id: int) -> bool:
        return self.local.forget(job_id)

    def cwd_problem(self, cwd: str, uid: int, gid: int) -> Optional[str]:
        return self.local.cwd_problem(cwd, uid, gid)

    def read_log(self, job_id: int, offset: Optional[int], size: int) -> bytes:
        return self.local.read_log(job_id, offset, size)

    # The node's socket (node/gateway.py): the head's forwarding calls, in their own Ray
    # concurrency group (node/raypool.py) so that a long poll never waits behind a tick's calls.
    def take(self, wait_s: float) -> tuple[int, list[ForwardedRequest]]:
        return self.gateway.take(wait_s)

    def ack(self, token: int, request_ids: list[int]) -> list[int]:
        return self.gateway.ack(token, request_ids)

    def answer(self, request_id: int, response: ForwardedResponse) -> bool:
        return self.gateway.answer(request_id, response)
