"""The per-job supervisor: one small process per job launch, independent of the daemon.

Why a separate process: the daemon may be killed at any instant. The supervisor is the job's
parent, so it alone can collect the exit status; it writes it to `status.json` before exiting,
and the next daemon reads it there. It also serves the job's control socket, so a job parked in
RAM stays connected to something that never goes away while the daemon restarts.

Run directory (made by the daemon before spawning us; protocol/rundir.py has its files' records):
  spec.json     what to run: argv, cwd, env, uid/gid, log path, control address (`Spec`)
  desired.json  what the daemon wants now: run, tier, sigstop, cancel, max_bytes (`Desired`)
  status.json   what is (written by us, atomically, on every change; the daemon reads it back
                through protocol/status.py)
  lock          flock held for our whole life: the daemon's liveness check, immune to PID reuse
  spawned.json  written by the daemon once we exist (launcher.py: a lost spawn is redone)
  control       the job's control socket (ours to bind; the job owner's file, mode 0600)

The job starts through `execshim.py`, which drops to the user *before* entering the job's
directory, and arms a parent-death signal: if we die, the job's main process is killed with us
(the daemon then kills the rest of its session: `sessions.py`). Its pid, the session id, is in
status.json before the user's program runs, so the daemon can always find what to kill.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from gpuswap import peercred, processes
from gpuswap.exitcodes import EX_USAGE
from gpuswap.fsutil import atomic_write_json, make_file, read_json
from gpuswap.node import execshim, sessions
from gpuswap.protocol import channel, messages, records, rundir
from gpuswap.protocol.rundir import Desired, Spec
from gpuswap.protocol.status import ExitFacts, SupervisorStatus
from gpuswap.runtime.ranktable import RankTable

CANCEL_GRACE_S = 10.0
POLL_S = 0.05
MAX_BAD = 64          # invalid control messages one connection may send before it is closed
MAX_COMPLAINTS = 20   # supervisor.log lines about them, for the supervisor's whole life
USAGE_WRITE_S = 0.5   # usage reports reach status.json at most this often: each write is an fsync,
                      # and a job may send thousands of valid reports a second


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the peer, as the kernel recorded them at connect (not the job's word)."""
    p = peercred.peer(sock)
    return p.pid, p.uid


def peer_uid(sock: socket.socket) -> int:
    return peer_cred(sock)[1]


class Supervisor:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.spec: Spec = rundir.read_spec(run_dir)
        self.lock = threading.RLock()
        self.status = SupervisorStatus(job_id=self.spec.job_id, generation=self.spec.generation,
                                       supervisor_pid=os.getpid(), started_at=time.time())
        self.conn: Optional[socket.socket] = None
        self.sent: Optional[tuple[str, Optional[str]]] = None   # last request sent to the runtime
        self.child: Optional[subprocess.Popen] = None
        self.term_sent_at: Optional[float] = None
        self._desired_mtime: Optional[int] = None
        self.desired = Desired()
        self._complaints = 0
        self._unsaved = False         # status changed (or a write failed) and is not on disk yet
        self._written_at = 0.0        # monotonic time of the last status.json write
        self._write_failed = False    # said once in supervisor.log until a write succeeds again
        # A multi-rank job (its first hello says world_size > 1): the ranks' connections and the
        # common-step coordinator (runtime/ranktable.py); None for a single-rank job, which keeps `conn`.
        self.ranks: Optional[RankTable] = None
        self._ended_checkpointed = False
        self.kill_reason: Optional[str] = None
        self.pause_timeout_s = self.spec.pause_timeout_s

    # -- status -----------------------------------------------------------------------------
    def write_status(self) -> bool:
        """Write status.json; on a full disk keep the job running and retry from the main loop
        (the old file stays whole, and no temp file is left: fsutil)."""
        with self.lock:
            try:
                atomic_write_json(self.run_dir / rundir.STATUS, self.status.to_json())
            except OSError as e:
                if not self._write_failed:
                    self.log(f"cannot write status.json ({e.strerror or e}); retrying")
                self._unsaved = self._write_failed = True
                return False
            self._unsaved = self._write_failed = False
            self._written_at = time.monotonic()
            return True

    def _write_due(self) -> bool:
        """Whether a held-back usage report (or a failed write) should be written now."""
        return self._unsaved and time.monotonic() - self._written_at >= USAGE_WRITE_S

    def log(self, text: str) -> None:
        path = self.run_dir / rundir.SUPERVISOR_LOG
        try:
            if not path.exists():
                make_file(path, 0o600)
            with open(path, "a") as f:
                f.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        except OSError:
            pass    # a full disk must not take the job's supervisor down with it

    # -- the job process --------------------------------------------------------------------
    def start_child(self) -> bool:
        """Start the job through the exec shim; False (and the reason in status.json) if it could
        not start. Called from the main thread: the parent-death signal follows the forking thread."""
        spec = self.spec
        env = dict(spec.env)
        env.update(spec.extra_env)
        as_user = os.geteuid() == 0 and spec.uid != 0
        config = {"argv": spec.argv, "cwd": spec.cwd, "env": env,
                  "uid": spec.uid if as_user else None, "gid": spec.gid, "groups": spec.groups}
        cfg_r, cfg_w = os.pipe()
        st_r, st_w = os.pipe()
        log = open(spec.log_path, "ab", buffering=0)
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-I", "-S", execshim.__file__, str(cfg_r), str(st_w), str(os.getpid())],
                pass_fds=(cfg_r, st_w), env={}, cwd="/", stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as e:
            for fd in (cfg_w, st_r):
                os.close(fd)
            return self._not_started(f"cannot start {spec.argv[0]!r}: {getattr(e, 'strerror', None) or e}")
        finally:
            log.close()
            os.close(cfg_r)
            os.close(st_w)
        # Its pid is durable before the user's program can run (the shim waits for the config).
        with self.lock:
            self.status.job_pid = self.child.pid
            self.status.job_start_ticks = processes.start_ticks(self.child.pid)
        self.write_status()
        try:
            with open(cfg_w, "wb") as w:
                w.write(json.dumps(config).encode())
        except BrokenPipeError:
            pass
        with open(st_r, "rb") as r:
            failure = r.read()
        if not failure:
            return True
        self.child.wait()
        try:
            err = json.loads(failure)
        except ValueError:
            err = {"stage": "exec", "message": failure.decode(errors="replace")}
        why = err.get("message") or "unknown error"
        if err.get("stage") == "chdir":   # the directory failed, not the program
            reason = f"cannot start {spec.argv[0]!r}: its working directory {spec.cwd!r}: {why}"
        elif err.get("stage") == "credentials":
            reason = f"cannot start {spec.argv[0]!r}: cannot become uid {spec.uid}: {why}"
        else:
            reason = f"cannot start {spec.argv[0]!r}: {why}"
        return self._not_started(reason)

    def _not_started(self, reason: str) -> bool:
        with open(self.spec.log_path, "ab") as out:
            out.write(f"[gpuswap] {reason}\n".encode())
        with self.lock:
            self.status.exit = ExitFacts(code=None, signal=None, error=reason, time=time.time())
        self.write_status()
        return False

    def signal_group(self, sig: int) -> None:
        if self.child is None:
            return
        try:
            os.killpg(self.child.pid, sig)
        except ProcessLookupError:
            pass

    # -- control socket ---------------------------------------------------------------------
    def serve(self) -> None:
        """Bind the control socket: a path in our run directory (only the daemon can make entries
        there), then make it the job owner's, mode 0600; peers are checked by uid as well."""
        address = self.spec.control
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if not address.startswith("@"):
            try:
                os.unlink(address)        # a previous supervisor's, of this generation: we hold the lock
            except FileNotFoundError:
                pass
        channel.bind(srv, address)
        if not address.startswith("@"):
            owner = (self.spec.uid, self.spec.gid) if os.geteuid() == 0 else (-1, -1)
            os.chown(address, *owner)
            os.chmod(address, 0o600)
        srv.listen(4)
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        allowed = {0, os.geteuid(), self.spec.uid}
        while True:
            conn, _ = srv.accept()
            pid, uid = peer_cred(conn)
            if uid not in allowed:
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn, pid), daemon=True).start()

    def _read(self, conn: socket.socket, peer_pid: Optional[int] = None) -> None:
        """Serve one connection. Every line is validated (messages.py): a bad one is ignored and
        counted, and a connection that sends MAX_BAD of them is closed with one log line."""
        bad = 0
        try:
            for line in channel.read_lines(conn, messages.MAX_LINE):
                try:
                    if line is None:
                        raise messages.BadMessage(f"line longer than {messages.MAX_LINE} bytes")
                    msg = messages.parse(line)
                except messages.BadMessage as e:
                    bad += 1
                    with self.lock:
                        rt = self.status.runtime
                        rt["rejected"] = rt.get("rejected", 0) + 1
                        # Folded into the next write, like a usage report: a rejection counted after
                        # the last write would otherwise never reach status.json.
                        self._unsaved = True
                    if bad == 1:
                        self._log_limited(f"ignored an invalid control message ({e}); further ones are counted")
                    if bad >= MAX_BAD:
                        self._log_limited(f"closed a control connection after {bad} invalid messages")
                        break
                    continue
                if not self.on_message(conn, msg, peer_pid):
                    break
        except OSError:
            pass
        conn.close()
        with self.lock:
            if self.conn is conn:
                self.conn = None
                self.status.runtime["connected"] = False
            if self.ranks is not None:
                self.ranks.lost(conn, time.time())
                self._rank_facts()
        self.write_status()

    def _log_limited(self, text: str) -> None:
        """A job reconnecting to send junk must not fill the disk with our complaints."""
        self._complaints += 1
        if self._complaints <= MAX_COMPLAINTS:
            self.log(text + (" (no more such lines)" if self._complaints == MAX_COMPLAINTS else ""))

    def on_message(self, conn: socket.socket, msg: records.Report, peer_pid: Optional[int] = None) -> bool:
        """Fold one message into status and reconcile; False: close this connection."""
        if self.ranks is not None or (isinstance(msg, records.Hello) and (msg.world_size or 1) > 1):
            return self._on_rank_message(conn, msg, peer_pid)
        with self.lock:
            rt = self.status.runtime
            if isinstance(msg, records.Hello):   # sent again on every reconnect; `parked`: still parked in RAM
                self.conn = conn
                self.sent = None
                rt.update(connected=True, attached=True, state="paused" if msg.parked else "running",
                          pid=msg.pid, restored_step=msg.restored_step,
                          restored_bytes=msg.restored_bytes, restore_s=msg.restore_s,
                          restore_note=msg.restore_note)
                if msg.parked:
                    rt["tier"] = "ram"
                else:
                    rt["device_bytes"] = msg.device_bytes
            elif isinstance(msg, records.Usage):
                rt.update(device_bytes=msg.device_bytes, step=msg.step)
                self._unsaved = True      # folded into the next write (USAGE_WRITE_S): nothing to reconcile
                if not self._write_due():
                    return True
            elif isinstance(msg, records.Paused):
                rt.update(state="paused", tier=msg.tier, bytes=msg.bytes,
                          step=msg.step, pause_s=msg.seconds, device_bytes=0)
                self.sent = None
            elif isinstance(msg, records.Resumed):   # also the answer to a resume that cancelled a pending pause
                rt.update(state="running", tier=None, resume_s=msg.seconds,
                          device_bytes=msg.bytes or rt.get("device_bytes", 0))
                self.sent = None
            elif isinstance(msg, records.Checkpointed):
                rt.update(state="checkpointed", tier="disk", bytes=msg.bytes,
                          step=msg.step, pause_s=msg.seconds, ckpt_path=msg.path, ckpt_note=msg.note)
                self.sent = None
            elif isinstance(msg, records.RestoreFailed):   # no usable checkpoint; the job exits 1 right after
                rt.update(restore_failed=msg.message)
            elif isinstance(msg, records.Error):
                # The request failed; it is not re-sent (a full disk would make that a loop): the
                # daemon sees the error and changes what it wants.
                rt.update(error=msg.message, error_at=time.time())
            else:
                return True
        self.write_status()
        self.reconcile()
        return True

    # -- multi-rank jobs ---------------------------------------------------------------------
    def _on_rank_message(self, conn: socket.socket, msg: records.Report, peer_pid: Optional[int]) -> bool:
        now = time.time()
        with self.lock:
            if self.ranks is None:
                self.ranks = RankTable(self.pause_timeout_s, self._kill_ranks, self.log)
                self.log(f"multi-rank job: {msg.world_size if isinstance(msg, records.Hello) else '?'} ranks")
            if isinstance(msg, records.Hello):
                if (msg.world_size or 1) == 1 or not self.ranks.hello(conn, msg, peer_pid, now):
                    self._log_limited(f"refused a control connection (pid {peer_pid}): rank {msg.rank} of "
                                      f"{msg.world_size or 1} in a job of {self.ranks.coord.world_size} ranks, "
                                      "or a rank already connected")
                    self._rank_facts()
                    return False
                self.ranks.want(self.desired, now)
            elif isinstance(msg, records.Usage):
                self.ranks.receive(conn, msg, now)
                self._unsaved = True
                if not self._write_due():
                    return True
            elif isinstance(msg, records.RestoreFailed):
                self.status.runtime["restore_failed"] = msg.message
            else:
                self.ranks.receive(conn, msg, now)
            self._rank_facts()
        self.write_status()
        return True

    def _rank_facts(self) -> None:
        """status.json from the coordinator (under the lock): the job's facts, and the ranks'
        processes, which the daemon kills if this supervisor dies."""
        assert self.ranks is not None
        old = self.status.runtime
        rt = self.ranks.facts()
        for keep in ("rejected", "restore_failed"):
            if keep in old:
                rt[keep] = old[keep]
        self.status.runtime = rt
        self.status.rank_pids = self.ranks.pid_records()

    def _ranks_verdict(self) -> Optional[str]:
        """Why a multi-rank job's end is a failure whatever its exit code: the coordinator ended
        it, or its main process (the launcher) exited while the job was parked or mid-pause."""
        with self.lock:
            if self.ranks is None:
                return None
            if self.kill_reason is not None:
                return self.kill_reason
            phase = self.ranks.coord.phase
            if phase in ("running", "checkpointed"):
                return None
            return f"the job's main process (its launcher) ended while the job was {phase}; its ranks were killed"

    def _end_checkpointed(self) -> None:
        """A committed multi-rank checkpoint and every rank gone: end what is left (the launcher),
        under the lock. Left alone, torchrun with --max-restarts would start the ranks again on
        GPUs the daemon is about to give away; the verdict is already "checkpointed"."""
        assert self.ranks is not None
        if self.ranks.coord.phase != "checkpointed" or self._ended_checkpointed:
            return
        if any(r.connected for r in self.ranks.coord.ranks.values()):
            return
        self._ended_checkpointed = True
        self.log("checkpoint committed and every rank exited: ending the launcher")
        self.signal_group(signal.SIGTERM)
        self.ranks.kill_all()

    def _kill_rank_processes(self) -> int:
        with self.lock:
            return self.ranks.kill_all() if self.ranks is not None else 0

    def _kill_ranks(self, reason: str) -> None:
        """The coordinator's `Kill`: the job cannot go on. The launcher's process group gets SIGTERM
        (torchrun forwards it), every rank process SIGKILL: they are outside our session."""
        if self.kill_reason is None:
            self.kill_reason = reason
        self.signal_group(signal.SIGTERM)
        if self.ranks is not None:
            self.ranks.kill_all()
    def send(self, msg: records.Order) -> bool:
        conn = self.conn
        if conn is None:
            return False
        try:
            conn.sendall(records.encode(msg))
            return True
        except OSError:
            return False

    # -- reconcile desired vs actual --------------------------------------------------------
    def read_desired(self) -> None:
        path = self.run_dir / rundir.DESIRED
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._desired_mtime:
            self._desired_mtime = mtime
            raw = read_json(path)
            if raw:
                self.desired = Desired.from_json(raw)

    def reconcile(self) -> None:
        """Level-triggered: compare desired with actual and make the one move that is missing."""
        d = self.desired
        changed = False
        with self.lock:
            if self.child is None or self.status.exit is not None:
                return
            if d.cancel:
                if self.term_sent_at is None:
                    self.term_sent_at = time.monotonic()
                    self.signal_group(signal.SIGCONT)
                    self.signal_group(signal.SIGTERM)
                    self.log("cancel: SIGTERM sent to the job's process group")
                elif time.monotonic() - self.term_sent_at > CANCEL_GRACE_S:
                    self.signal_group(signal.SIGKILL)
                return
            want_stop = d.sigstop
            if want_stop != self.status.stopped:
                self.signal_group(signal.SIGSTOP if want_stop else signal.SIGCONT)
                self.log(f"{'SIGSTOP' if want_stop else 'SIGCONT'} sent to the job's process group")
                self.status.stopped = want_stop
                changed = True
            if self.ranks is not None:    # the coordinator answers the daemon for every rank
                now = time.time()
                before = self.ranks.facts()
                self.ranks.want(d, now)
                self.ranks.poll(now)
                if self.ranks.facts() != before:
                    self._rank_facts()
                    changed = True
                self._end_checkpointed()
        if self.ranks is not None:
            if changed:
                self.write_status()
            return
        with self.lock:
            rt = self.status.runtime
            state = rt.get("state")
            request: Optional[tuple[str, Optional[str]]] = None
            if d.pause_tier is not None:
                if state == "running" or (state == "paused" and rt.get("tier") == "ram" and d.pause_tier == "disk"):
                    request = ("pause", d.pause_tier)
            elif d.run == "running" and (state == "paused" or (state == "running" and self.sent
                                                                     and self.sent[0] == "pause")):
                # Resume a parked job, or withdraw a pause the job has not reached a safepoint for
                # (the daemon gave up waiting): left pending, it would park the job later anyway.
                request = ("resume", None)
            if request is not None and request != self.sent:
                msg: records.Order = (records.Pause(tier=request[1], max_bytes=d.max_bytes if request[1] == "ram" else None)
                                      if request[1] is not None else records.Resume())
                if self.send(msg):
                    self.sent = request
                    self.log(f"sent {records.wire(msg)}")
        if changed:
            self.write_status()

    # -- main -------------------------------------------------------------------------------
    def run(self) -> int:
        lock_fd = os.open(self.run_dir / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)          # held until we exit
        if (self.run_dir / rundir.STATUS).exists():
            # A second supervisor for this generation (the daemon died after spawning the first but
            # before recording it, and spawned again): the first has run or is gone. Start nothing.
            return 0
        # Only the daemon's desired.json stops a job. A handler, not SIG_IGN: an ignored
        # disposition would be inherited by the job through exec.
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        self.read_desired()
        self.serve()
        if not self.start_child():
            return 0
        assert self.child is not None
        pid = self.child.pid
        # Wait without reaping: while the exited main process is a zombie its pid (the session id)
        # cannot be reused, so the leftovers of its session are killed by an id that is still theirs.
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(POLL_S)
            self.read_desired()
            self.reconcile()
            if self._write_due():
                self.write_status()
        ended = self._ranks_verdict()   # before its ranks are killed: where the job stood
        # Until none is left, in its session or among its ranks (torchrun's workers lead sessions of
        # their own): its GPUs are free only then.
        while sessions.kill(pid, self.status.job_start_ticks) + self._kill_rank_processes():
            time.sleep(POLL_S)
        rc = self.child.wait()
        sig = -rc if rc < 0 else None
        error = None
        if ended is not None:
            how = f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() else \
                f"signal {sig}" if sig else f"code {rc}"
            error = f"{ended} (main process: {how})"
        with self.lock:
            self.status.exit = ExitFacts(code=128 + sig if sig else rc, signal=sig, error=error, time=time.time())
            self.status.runtime["connected"] = False
        while not self.write_status():   # the exit status must land; wait for room on the disk
            time.sleep(1.0)
        return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpuswap.node.supervisor RUN_DIR", file=sys.stderr)
        return EX_USAGE
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
