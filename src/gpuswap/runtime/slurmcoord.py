"""The common-step coordinator of a multi-rank Slurm job, run inside the job (no daemon there).

Under Slurm there is no supervisor, so whoever receives the preemption signal first must be able
to stop every rank at one step: `gpuswap slurm-wrap` (the parent of torchrun) runs this server,
or, for `srun --ntasks N` jobs, the task with rank 0 runs it on a thread. Each rank connects to
it exactly as it connects to a supervisor (`$GPUSWAP_CONTROL`), and the same `Coordinator` runs
over the same per-rank connection table (`ranktable.py`); a preemption signal becomes
`want("paused", "disk")`. Once the manifest is committed, `committed` is set: the owner requeues
the job (docs/design/multi-rank.md section 9).

The socket lives in a private directory (`$TMPDIR/gpuswap-$SLURM_JOB_ID`, mode 0700, ours):
a Unix socket on one node, so multi-node jobs are refused before anything starts (`why_not`).
"""
from __future__ import annotations

import os
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Optional

from gpuswap import processes
from gpuswap.peercred import peer
from gpuswap.protocol import channel
from gpuswap.protocol.env import SLURM_PAUSE_TIMEOUT_S
from gpuswap.protocol.rundir import Desired

DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.5


def nodes(env: Mapping[str, str] = os.environ) -> int:
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        try:
            return int(env[key])
        except (KeyError, ValueError):
            continue
    return 1


def why_not(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why a multi-rank Slurm job cannot be coordinated here, or None."""
    n = nodes(env)
    if n > 1:
        return (f"this Slurm job spans {n} nodes; gpuswap coordinates the ranks of a single-node job "
                "only (its coordinator is a Unix socket)")
    return None


def private_dir(env: Mapping[str, str] = os.environ) -> Path:
    """`$TMPDIR/gpuswap-$SLURM_JOB_ID`, created 0700; refused (OSError) if it exists and is not a
    directory of ours that only we can enter: another user could otherwise own the socket's name."""
    d = Path(env.get("TMPDIR") or "/tmp") / f"gpuswap-{env['SLURM_JOB_ID']}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{d} is not a directory owned by uid {os.geteuid()}")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
    return d


def timeout_s(env: Mapping[str, str] = os.environ) -> float:
    try:
        value = float(env.get(SLURM_PAUSE_TIMEOUT_S, "") or DEFAULT_TIMEOUT_S)
    except ValueError:
        value = -1.0
    if not 1.0 <= value <= 86400.0:
        print(f"gpuswap: ignoring {SLURM_PAUSE_TIMEOUT_S}={env.get(SLURM_PAUSE_TIMEOUT_S)!r}: not 1..86400 s; "
              f"using {DEFAULT_TIMEOUT_S:g}", file=sys.stderr, flush=True)
        return DEFAULT_TIMEOUT_S
    return value


def _log(text: str) -> None:
    print(f"gpuswap: {text}", file=sys.stderr, flush=True)


class CoordServer:
    """A control socket for every rank of the job, and the coordinator behind it.

    `on_kill(reason)` is called (from a server thread) when the job cannot go on: a rank died
    while the others were writing their parts, or a phase outlived the timeout."""

    def __init__(self, path: Path, timeout: float, on_kill: Callable[[str], None]) -> None:
        from gpuswap.runtime.ranktable import RankTable   # pydantic: only when coordinating

        self.path = path
        self.lock = threading.RLock()
        self.table = RankTable(timeout, on_kill, _log)
        self.committed = threading.Event()
        self._srv: Optional[socket.socket] = None
        self._closed = False

    def start(self) -> None:
        try:
            os.unlink(self.path)      # left by an earlier run of this job (a requeue keeps the job id)
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        channel.bind(srv, str(self.path))
        os.chmod(self.path, 0o600)
        srv.listen(64)
        self._srv = srv
        for target, name in ((self._accept, "gpuswap-coord"), (self._poll, "gpuswap-coord-poll")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        if self._srv is not None:
            try:
                self._srv.close()
            finally:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass

    # -- what the owner asks -------------------------------------------------------------------
    def attached(self) -> bool:
        """Some rank has said hello: this job speaks the multi-rank protocol."""
        with self.lock:
            return self.table.coord.world_size is not None

    def preempt(self, why: str) -> Optional[str]:
        """A preemption signal: every rank checkpoints at a common step. Any number of requests
        make one pause. Returns why it cannot start now (ranks not all attached yet: it starts
        when they are; or refused), or None."""
        with self.lock:
            coord = self.table.coord
            if coord.phase not in ("running", "agreeing"):
                _log(f"{why}: the checkpoint is already {coord.phase}")
                return None
            told = coord.error_at
            self.table._wanted = None     # a new signal is a new request, even after a withdrawn one
            self.table.want(Desired(run="paused", tier="disk"), time.time())
            if coord.phase == "running" and coord.error_at != told:
                return coord.error      # refused (RankTable said why)
            waiting = coord.pausable() if coord.phase == "running" else None
        _log(f"{why}: every rank checkpoints at a common step" + (f" once it can ({waiting})" if waiting else ""))
        return waiting

    def kill_ranks(self, but: Optional[int] = None) -> int:
        """SIGKILL every process that was a rank (torchrun's workers lead sessions of their own)."""
        with self.lock:
            procs = [p for p in self.table.processes.values() if p.pid != but]
        return processes.kill_pids([(p.pid, p.start_ticks) for p in procs])

    # -- threads ---------------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self._srv is not None
        me = os.geteuid()
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            pid, uid, _gid = peer(conn)
            ticks = processes.start_ticks(pid) if pid else None    # now: with the pid, names it for good
            if uid != me:
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn, pid, ticks), daemon=True, name="gpuswap-coord-rank").start()

    def _read(self, conn: socket.socket, pid: int, ticks: Optional[int] = None) -> None:
        from gpuswap.protocol import messages, records   # the gate (pydantic): only when coordinating

        try:
            for line in channel.read_lines(conn, messages.MAX_LINE):
                try:
                    if line is None:
                        raise messages.BadMessage("line too long")
                    msg = messages.parse(line)
                except messages.BadMessage:
                    continue       # the ranks are this job's own processes: a bad line is dropped
                if isinstance(msg, records.Preempt):
                    self.preempt(f"rank {self._rank_of(conn)} got {msg.signal or 'a preemption signal'}")
                    continue
                with self.lock:
                    now = time.time()
                    if isinstance(msg, records.Hello):
                        if (msg.world_size or 1) == 1 or not self.table.hello(conn, msg, pid, now, ticks):
                            _log(f"refused a control connection (pid {pid}): rank {msg.rank} of "
                                 f"{msg.world_size or 1}, or a rank already connected")
                            break
                    elif isinstance(msg, records.RestoreFailed):
                        _log(f"a rank cannot restore: {msg.message}")
                    else:
                        self.table.receive(conn, msg, now)
                    self._check()
        except OSError:
            pass
        conn.close()
        with self.lock:
            self.table.lost(conn, time.time())
            self._check()

    def _rank_of(self, conn: socket.socket) -> str:
        with self.lock:
            r = self.table.conns.get(conn)
        return "?" if r is None else str(r)

    def _poll(self) -> None:
        while not self._closed:
            time.sleep(POLL_S)
            with self.lock:
                self.table.poll(time.time())
                self._check()

    def _check(self) -> None:
        if self.table.coord.phase == "checkpointed" and not self.committed.is_set():
            path = self.table.coord.result.get("ckpt_path")
            _log(f"every rank's part is written and the checkpoint committed ({path})")
            self.committed.set()
