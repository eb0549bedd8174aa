"""Starting supervisors and talking to them through their run directory.

Each launch of a job (first start, or restart after a disk park) is a *generation* with its own
run directory, so a status file can never be mistaken for another launch's. The daemon writes
`desired.json`; it reads `status.json`; liveness is whether the supervisor still holds the flock on
`lock` (the kernel drops it when the process dies, so PID reuse cannot fool us).

A launch is done when `spawned.json` exists, written only after the supervisor process exists: a
daemon killed between writing `spec.json` and spawning leaves no marker, and the restarted daemon
spawns it then. One killed after spawning but before the marker spawns a second supervisor; the
supervisor takes the lock and starts nothing when the generation has already run
(`supervisor.py`), so a job never runs twice.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import pwd
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuswap.fsutil import atomic_write_json, read_json
from gpuswap.node import messages
from gpuswap.runtime import channel

# How long a freshly spawned supervisor may take to write its first status before we call the
# launch lost (a cold Python start on a loaded machine takes well under a second).
SPAWN_GRACE_S = 30.0


@dataclass(frozen=True)
class Observation:
    status: Optional[dict[str, Any]]   # the supervisor's status.json, if written
    alive: bool                        # supervisor holds its lock
    spawned_at: Optional[float]        # when the daemon spawned this generation's supervisor

    # The status file's values reach SQLite: read them only through these, which validate
    # (messages.py); the runtime facts came from the job.
    @property
    def exit(self) -> Optional[dict[str, Any]]:
        return messages.exit_facts(self.status.get("exit")) if isinstance(self.status, dict) else None

    @property
    def runtime(self) -> dict[str, Any]:
        return messages.runtime_facts(self.status.get("runtime")) if isinstance(self.status, dict) else {}

    @property
    def job_pid(self) -> Optional[int]:
        return messages.pid_or_none(self.status.get("job_pid")) if isinstance(self.status, dict) else None

    @property
    def stopped(self) -> bool:
        return isinstance(self.status, dict) and self.status.get("stopped") is True


class Launcher:
    def __init__(self, home: Path, simulated: bool):
        self.home = home
        self.simulated = simulated
        self._children: list[subprocess.Popen] = []
        self._tag = hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:12]

    def job_dir(self, job_id: int) -> Path:
        return self.home / "jobs" / str(job_id)

    def run_dir(self, job_id: int, generation: int) -> Path:
        return self.job_dir(job_id) / f"run-{generation}"

    def log_path(self, job_id: int) -> Path:
        return self.job_dir(job_id) / "output.log"

    def ckpt_dir(self, job_id: int) -> Path:
        return self.job_dir(job_id) / "ckpt"

    def control_address(self, job_id: int, generation: int) -> str:
        return f"@gpuswap/{self._tag}/{job_id}/{generation}"

    def launch(self, job: Any, env: dict[str, str], generation: int, gpu_env: str,
               desired: dict[str, Any]) -> None:
        """Spawn a supervisor for this generation unless one was already spawned (idempotent)."""
        run = self.run_dir(job.id, generation)
        if self.spawned(job.id, generation):
            return
        run.mkdir(parents=True, exist_ok=True)
        ckpt = self.ckpt_dir(job.id)
        ckpt.mkdir(parents=True, exist_ok=True)
        log = self.log_path(job.id)
        log.touch(exist_ok=True)
        if os.geteuid() == 0 and job.uid != 0:
            os.chown(ckpt, job.uid, job.gid)
        extra_env = {
            "CUDA_VISIBLE_DEVICES": gpu_env,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            channel.ENV_JOB_ID: str(job.id),
            channel.ENV_CONTROL: self.control_address(job.id, generation),
            channel.ENV_CKPT_DIR: str(ckpt),
        }
        if self.simulated:
            extra_env[channel.ENV_SIMULATED] = "1"
        groups = _supplementary_groups(job.uid, job.gid)
        if not (run / "desired.json").exists():     # a respawn keeps what the daemon asked since
            atomic_write_json(run / "desired.json", desired)
        atomic_write_json(run / "spec.json", {
            "job_id": job.id, "generation": generation, "argv": job.argv, "cwd": job.cwd,
            "env": env,
            "extra_env": extra_env, "uid": job.uid, "gid": job.gid,
            "groups": groups, "log_path": str(log),
            "control": self.control_address(job.id, generation),
        })
        with open(run / "supervisor.err", "ab") as err:
            child = subprocess.Popen(
                [sys.executable, "-m", "gpuswap.node.supervisor", str(run)],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
                cwd="/",
            )
        self._children.append(child)
        atomic_write_json(run / "spawned.json", {"pid": child.pid, "time": time.time()})

    def spawned(self, job_id: int, generation: int) -> bool:
        return (self.run_dir(job_id, generation) / "spawned.json").exists()

    def set_desired(self, job_id: int, generation: int, desired: dict[str, Any]) -> None:
        path = self.run_dir(job_id, generation) / "desired.json"
        if path.parent.exists() and read_json(path) != desired:
            atomic_write_json(path, desired)

    def observe(self, job_id: int, generation: int) -> Observation:
        run = self.run_dir(job_id, generation)
        spawned = read_json(run / "spawned.json")
        return Observation(
            status=read_json(run / "status.json"),
            alive=_lock_held(run / "lock"),
            spawned_at=spawned["time"] if spawned else None,
        )

    def reap(self) -> None:
        """Collect exited supervisors we spawned, so none lingers as a zombie."""
        self._children = [p for p in self._children if p.poll() is None]


def _supplementary_groups(uid: int, gid: int) -> list[int]:
    """The submitting user's groups, so the job runs with exactly the rights a login would have."""
    if os.geteuid() != 0 or uid == 0:
        return []
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except KeyError:
        return [gid]


def _lock_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)   # closing also drops the lock if we took it
    return False
