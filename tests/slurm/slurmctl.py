"""A private single-node Slurm (munged, slurmctld, slurmd) started and stopped by the tests.

Two partitions on one node: `high` (PriorityTier 10) preempts `low` (PriorityTier 1) by REQUEUE.
Everything (config, state, logs, munge key and socket, ports) lives in one temp directory, so it
neither needs nor touches a system Slurm. Daemons run as root, without cgroups
(proctrack/linuxproc, task/none), which also works in containers and gVisor-like sandboxes.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo")
SEARCH_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SETUP_HINT = "run tests/setup-system.sh as root (apt-get install slurm-wlm munge)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not_available(path: str = SEARCH_PATH) -> str | None:
    """Why a real Slurm cannot run here (the programs missing from `path`), or None when it can.
    Only looks: installing is tests/setup-system.sh's job, never a test run's."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b, path=path) is None]
    if missing:
        return f"Slurm/munge programs not installed ({', '.join(missing)}); {SETUP_HINT}"
    return None


SLURM_CONF = """\
ClusterName=gpuswaptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/linear
ReturnToService=2
JobRequeue=1
RequeueExit=75
MinJobAge=600
KillWait=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# 22.05 spelling; 23.02+ writes PreemptParameters=send_user_signal
SlurmctldParameters=preempt_send_user_signal
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=low Nodes={host} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=60 MaxTime=30
PartitionName=high Nodes={host} PriorityTier=10 PreemptMode=OFF MaxTime=30
"""


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.dir = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_dir = root / "munge"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for k in list(self.env):
            if k.startswith(("SLURM_", "GPUSWAP_")) and k != "SLURM_CONF":
                del self.env[k]

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(mode=0o700, exist_ok=True)
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._run(["/usr/sbin/munged", "--force", f"--key-file={key}",
                   f"--socket={self.munge_dir / 'sock'}", f"--pid-file={self.munge_dir / 'pid'}",
                   f"--log-file={self.munge_dir / 'log'}", f"--seed-file={self.munge_dir / 'seed'}"])
        self.conf.write_text(SLURM_CONF.format(
            host=self.host, ctld_port=free_port(), d_port=free_port(), d=self.dir,
            munge_socket=self.munge_dir / "sock", cpus=os.cpu_count() or 1))
        self._run(["/usr/sbin/slurmctld", "-i"])
        self._run(["/usr/sbin/slurmd", "-N", self.host])
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if res.returncode == 0 and res.stdout.split() and all(
                    s.rstrip("*") == "idle" for s in res.stdout.split()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm node never became idle:\n{self.logs()}")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        # Each daemon takes ~2 s to stop on SIGTERM: slurmd and slurmctld stop side by side, then
        # munged, which both may still use while they stop.
        for group in ((self.dir / "slurmd.pid", self.dir / "slurmctld.pid"), (self.munge_dir / "pid",)):
            pids = []
            for pidfile in group:
                try:
                    pid = int(pidfile.read_text().strip())
                    os.kill(pid, signal.SIGTERM)
                except (OSError, ValueError):
                    continue
                pids.append(pid)
            for pid in pids:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    try:
                        os.kill(pid, 0)
                    except OSError:
                        break
                    time.sleep(0.05)

    def _run(self, cmd: list[str]) -> None:
        res = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({res.returncode}): {res.stderr}\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in (self.dir / "log" / "slurmctld.log", self.dir / "log" / "slurmd.log", self.munge_dir / "log"):
            if f.exists():
                out.append(f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(out)

    # -- client commands -------------------------------------------------------------------
    def sbatch(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
        res = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env, cwd=cwd,
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        res = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env,
                             capture_output=True, text=True, timeout=120)
        fields: dict[str, str] = {}
        for word in res.stdout.split():
            k, _, v = word.partition("=")
            fields.setdefault(k, v)
        return fields

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {info}\n{self.logs()}")
