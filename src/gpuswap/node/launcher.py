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

Who may see what (docs/architecture.md, "Identity and permissions"): every directory here is the
daemon's and mode 0711 (others may pass through, never list); every file is 0600. The job's owner
gets exactly three things: `output.log` and `ckpt/` (theirs, 0600 and 0700: a checkpoint is safe
whatever the job's umask), and the control socket `run-GEN/control` (theirs, 0600; made by the
supervisor). Modes are set explicitly, whatever the daemon's umask.
"""
from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

from gpuswap.fsutil import make_dir, make_file, read_json
from gpuswap.protocol import rundir
from gpuswap.protocol.env import JobEnv
from gpuswap.protocol.rundir import Desired, Spawned, Spec
from gpuswap.protocol.status import ExitFacts, RuntimeFacts, SupervisorReport

# How long a freshly spawned supervisor may take to write its first status before we call the
# launch lost (a cold Python start on a loaded machine takes well under a second).
SPAWN_GRACE_S = 30.0

DIR_MODE = 0o711        # the daemon's directories: others may traverse (to reach their own files)


@dataclass(frozen=True)
class Observation:
    status: Optional[dict[str, Any]]   # the supervisor's status.json, if written
    alive: bool                        # supervisor holds its lock
    spawned_at: Optional[float]        # when the daemon spawned this generation's supervisor

    # The status file's values reach SQLite: read them only through these, which validate
    # (protocol/status.py); the runtime facts came from the job.
    @cached_property
    def report(self) -> SupervisorReport:
        return SupervisorReport.parse(self.status)

    @property
    def exit(self) -> Optional[ExitFacts]:
        return self.report.exit

    @property
    def runtime(self) -> RuntimeFacts:
        return self.report.runtime

    @property
    def job_pid(self) -> Optional[int]:
        return self.report.job_pid

    @property
    def job_start_ticks(self) -> Optional[int]:
        return self.report.job_start_ticks

    @property
    def rank_pids(self) -> list[tuple[int, Optional[int]]]:
        return list(self.report.rank_pids)

    @property
    def stopped(self) -> bool:
        return self.report.stopped


class Launcher:
    def __init__(self, home: Path, simulated: bool, pause_timeout_s: float):
        self.home = home
        self.simulated = simulated
        self.pause_timeout_s = pause_timeout_s   # a multi-rank job's supervisor bounds each phase by it
        self._children: list[subprocess.Popen] = []

    def job_dir(self, job_id: int) -> Path:
        return self.home / "jobs" / str(job_id)

    def run_dir(self, job_id: int, generation: int) -> Path:
        return self.job_dir(job_id) / f"run-{generation}"

    def log_path(self, job_id: int) -> Path:
        return self.job_dir(job_id) / "output.log"

    def ckpt_dir(self, job_id: int) -> Path:
        return self.job_dir(job_id) / "ckpt"

    def control_address(self, job_id: int, generation: int) -> str:
        """A path in a directory only the daemon can create entries in: nobody can claim it."""
        return str(self.run_dir(job_id, generation) / rundir.CONTROL)

    def launch(self, job: Any, env: dict[str, str], generation: int, gpu_env: str,
               desired: Desired) -> None:
        """Spawn a supervisor for this generation unless one was already spawned (idempotent)."""
        run = self.run_dir(job.id, generation)
        if self.spawned(job.id, generation):
            return
        owner = (job.uid, job.gid) if os.geteuid() == 0 else (-1, -1)
        make_dir(self.job_dir(job.id), DIR_MODE)
        make_dir(run, DIR_MODE)
        ckpt = self.ckpt_dir(job.id)
        make_dir(ckpt, 0o700, *owner)
        log = self.log_path(job.id)
        make_file(log, 0o600, *owner)
        given = JobEnv(job_id=str(job.id), control=self.control_address(job.id, generation), ckpt_dir=str(ckpt),
                       simulated=self.simulated,   # then the simulated driver's directory: daemon.sim_device_dir
                       sim_cuda_dir=str(self.home / "simulated-driver") if self.simulated else None)
        extra_env = {"CUDA_VISIBLE_DEVICES": gpu_env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", **given.to_env()}
        groups = _supplementary_groups(job.uid, job.gid)
        if not (run / rundir.DESIRED).exists():     # a respawn keeps what the daemon asked since
            rundir.write(run, rundir.DESIRED, desired)
        rundir.write(run, rundir.SPEC, Spec(
            job_id=job.id, generation=generation, argv=job.argv, cwd=job.cwd, env=env, extra_env=extra_env,
            uid=job.uid, gid=job.gid, groups=groups, log_path=str(log),
            control=self.control_address(job.id, generation), pause_timeout_s=self.pause_timeout_s))
        make_file(run / rundir.SUPERVISOR_ERR, 0o600)
        with open(run / rundir.SUPERVISOR_ERR, "ab") as err:
            child = subprocess.Popen(
                [sys.executable, "-m", "gpuswap.node.supervisor", str(run)],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True,
                cwd="/",
            )
        self._children.append(child)
        rundir.write(run, rundir.SPAWNED, Spawned(pid=child.pid, time=time.time()))

    def spawned(self, job_id: int, generation: int) -> bool:
        return (self.run_dir(job_id, generation) / rundir.SPAWNED).exists()

    def set_desired(self, job_id: int, generation: int, desired: Desired) -> None:
        run = self.run_dir(job_id, generation)
        if run.exists() and rundir.read_desired(run) != desired:
            rundir.write(run, rundir.DESIRED, desired)

    def observe(self, job_id: int, generation: int) -> Observation:
        run = self.run_dir(job_id, generation)
        spawned = rundir.read_spawned(run)
        return Observation(
            status=read_json(run / rundir.STATUS),
            alive=_lock_held(run / rundir.LOCK),
            spawned_at=spawned.time if spawned else None,
        )

    def reap(self) -> None:
        """Collect exited supervisors we spawned, so none lingers as a zombie."""
        self._children = [p for p in self._children if p.poll() is None]


CWD_CHECK_TIMEOUT_S = 10.0
ENV = shutil.which("env", path="/usr/bin:/bin") or "/usr/bin/env"   # coreutils: `env -C DIR CMD`


def cwd_problem(cwd: str, uid: int, gid: int) -> Optional[str]:
    """Why the user `uid` cannot enter `cwd` (None: they can). The kernel decides, as the user: a
    short `env -C CWD true` run under their uid, gid and groups; never our own reading of modes.
    The job still enters it only as the user (execshim.py): this check is for a clear refusal."""
    if not os.path.isabs(cwd):
        return f"working directory {cwd!r} is not an absolute path"
    try:
        if os.geteuid() != 0 or uid == os.geteuid():     # the caller is who we are: ask access(2)
            if not os.path.isdir(cwd):
                return f"working directory {cwd!r} does not exist or is not a directory"
            if not os.access(cwd, os.X_OK):
                return f"working directory {cwd!r} cannot be entered: Permission denied"
            return None
        res = subprocess.run(
            [ENV, "-C", cwd, "true"], user=uid, group=gid, extra_groups=_supplementary_groups(uid, gid),
            env={"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, cwd="/", stdin=subprocess.DEVNULL,
            capture_output=True, timeout=CWD_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"working directory {cwd!r} did not answer within {CWD_CHECK_TIMEOUT_S:g} s"
    except (OSError, ValueError, subprocess.SubprocessError) as e:   # NUL bytes, unknown uid, ...
        return f"working directory {cwd!r} cannot be checked: {getattr(e, 'strerror', None) or e}"
    if res.returncode == 0:
        return None
    lines = res.stderr.decode(errors="replace").strip().splitlines()
    why = lines[-1].rsplit(": ", 1)[-1] if lines else f"exit code {res.returncode}"
    return f"working directory {cwd!r} cannot be entered by uid {uid}: {why}"


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
