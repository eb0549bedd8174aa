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
from gpuswap.node import lastckpt
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
    # When desired.json, as the supervisor reads it, last asked for a pause (its mtime); None when
    # it does not ask for one. A pause recorded but not yet written (a full disk) has not reached
    # the supervisor: its timeout must not run (observe.py).
    pause_delivered_at: Optional[float] = None

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


# A pool node's agent (node/agent.py) is a Ray worker, and Ray kills a worker's direct children
# when it exits (RAY_kill_child_processes_on_worker_exit, on by default): its supervisors are
# started through this, which starts one in its own session and exits, so they are nobody's
# child but init's and outlive the agent. Its stdout says the supervisor's pid.
_DETACH = ("import subprocess, sys\n"
           "p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=2, stderr=2, "
           "start_new_session=True, cwd='/')\n"
           "print(p.pid)")


class Launcher:
    def __init__(self, home: Path, simulated: bool, pause_timeout_s: float, detach: bool = False,
                 ckpt_root: Optional[Path] = None):
        self.home = home
        self.ckpt_root = ckpt_root              # a pool's shared checkpoint directory (docs/ray.md)
        self.simulated = simulated
        self.pause_timeout_s = pause_timeout_s   # a multi-rank job's supervisor bounds each phase by it
        self.detach = detach                     # supervisors not our children (a pool agent's)
        self._children: list[subprocess.Popen] = []

    def job_dir(self, job_id: int) -> Path:
        return self.home / "jobs" / str(job_id)

    def run_dir(self, job_id: int, generation: int) -> Path:
        return self.job_dir(job_id) / f"run-{generation}"

    def log_path(self, job_id: int) -> Path:
        return log_file(self.home, job_id)

    def ckpt_dir(self, job_id: int) -> Path:
        """Where the job's disk checkpoints are: in its job directory, or in a pool whose nodes
        share storage, under the shared directory, at the same path on every node."""
        return self.job_dir(job_id) / "ckpt" if self.ckpt_root is None else self.ckpt_root / str(job_id)

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
                       simulated=self.simulated,   # then the simulated driver's directory: drivers.sim_device_dir
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
        argv = [sys.executable, "-m", "gpuswap.node.supervisor", str(run)]
        with open(run / rundir.SUPERVISOR_ERR, "ab") as err:
            if self.detach:
                done = subprocess.run([sys.executable, "-c", _DETACH, *argv], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=err, start_new_session=True, cwd="/",
                                      check=True)
                pid = int(done.stdout.decode().strip())
            else:
                child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         start_new_session=True, cwd="/")
                self._children.append(child)
                pid = child.pid
        rundir.write(run, rundir.SPAWNED, Spawned(pid=pid, time=time.time()))

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
            pause_delivered_at=_pause_delivered_at(run),
        )

    def forget(self, job_id: int) -> bool:
        """Delete a finished job's files (its directory, and its checkpoints where they are kept
        apart); False, touching nothing, while a supervisor of it still holds a run lock."""
        job_dir = self.job_dir(job_id)
        try:
            runs = [p for p in job_dir.iterdir() if p.name.startswith("run-")]
        except OSError:
            runs = []
        if any(_lock_held(run / rundir.LOCK) for run in runs):
            return False
        shutil.rmtree(job_dir, ignore_errors=True)
        if self.ckpt_root is not None:
            shutil.rmtree(self.ckpt_dir(job_id), ignore_errors=True)
        return not job_dir.exists() and (self.ckpt_root is None or not self.ckpt_dir(job_id).exists())

    def last_checkpoint(self, job_id: int, width: int = 1) -> Optional[tuple[int, int]]:
        """(step, bytes) of the job's newest committed disk checkpoint that a job of `width` ranks
        restores from (node/lastckpt.py: the owner's files, read as root without trusting them)."""
        return lastckpt.last_checkpoint(self.ckpt_dir(job_id), width)

    def live_runs(self) -> list[tuple[int, int]]:
        """(job id, generation) of every supervisor alive under this home (its lock held): what
        runs here, whatever the records say (a pool node compares it with the head's)."""
        out = []
        try:
            jobs = list(os.scandir(self.home / "jobs"))
        except FileNotFoundError:
            return []
        for entry in jobs:
            if not entry.name.isdigit() or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                runs = list(os.scandir(entry.path))
            except OSError:                 # forgotten meanwhile (retention)
                continue
            for run in runs:
                name = run.name
                if name.startswith("run-") and name[4:].isdigit() and _lock_held(Path(run.path) / rundir.LOCK):
                    out.append((int(entry.name), int(name[4:])))
        return sorted(out)

    def reap(self) -> None:
        """Collect exited supervisors we spawned, so none lingers as a zombie."""
        self._children = [p for p in self._children if p.poll() is None]


CWD_CHECK_TIMEOUT_S = 10.0
ENV = shutil.which("env", path="/usr/bin:/bin") or "/usr/bin/env"   # coreutils: `env -C DIR CMD`


def log_file(home: Path, job_id: int) -> Path:
    """A job's output, in the state directory of the daemon or pool node that ran it."""
    return home / "jobs" / str(job_id) / "output.log"


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


def _pause_delivered_at(run: Path) -> Optional[float]:
    try:
        written = os.stat(run / rundir.DESIRED).st_mtime
    except OSError:
        return None
    desired = rundir.read_desired(run)
    return written if desired is not None and desired.run == "paused" else None


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
