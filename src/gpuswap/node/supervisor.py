"""The per-job supervisor: one small process per job launch, independent of the daemon.

Why a separate process: the daemon may be killed at any instant. The supervisor is the job's
parent, so it alone can collect the exit status; it writes it to `status.json` before exiting,
and the next daemon reads it there. It also serves the job's control socket, so a job parked in
RAM stays connected to something that never goes away while the daemon restarts.

Run directory (made by the daemon before spawning us):
  spec.json     what to run: argv, cwd, env, uid/gid, log path, control address
  desired.json  what the daemon wants now: {"run": "running"|"paused", "tier", "sigstop", "cancel"}
  status.json   what is (written by us, atomically, on every change)
  lock          flock held for our whole life: the daemon's liveness check, immune to PID reuse
  spawned.json  written by the daemon once we exist (launcher.py: a lost spawn is redone)
"""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from gpuswap.fsutil import atomic_write_json, read_json
from gpuswap.runtime import channel

CANCEL_GRACE_S = 10.0
POLL_S = 0.05


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class Supervisor:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.spec: dict[str, Any] = read_json(run_dir / "spec.json")
        self.lock = threading.RLock()
        self.status: dict[str, Any] = {
            "job_id": self.spec["job_id"],
            "generation": self.spec["generation"],
            "supervisor_pid": os.getpid(),
            "job_pid": None,
            "started_at": time.time(),
            "runtime": {"connected": False, "attached": False, "state": None},
            "stopped": False,
            "exit": None,
        }
        self.conn: Optional[socket.socket] = None
        self.sent: Optional[tuple[str, Optional[str]]] = None   # last request sent to the runtime
        self.child: Optional[subprocess.Popen] = None
        self.term_sent_at: Optional[float] = None
        self._desired_mtime: Optional[int] = None
        self.desired: dict[str, Any] = {"run": "running"}

    # -- status -----------------------------------------------------------------------------
    def write_status(self) -> None:
        with self.lock:
            atomic_write_json(self.run_dir / "status.json", self.status)

    def log(self, text: str) -> None:
        with open(self.run_dir / "supervisor.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    # -- the job process --------------------------------------------------------------------
    def start_child(self) -> bool:
        spec = self.spec
        env = dict(spec["env"])
        env.update(spec["extra_env"])
        kwargs: dict[str, Any] = {}
        if os.geteuid() == 0 and spec["uid"] != 0:
            kwargs.update(user=spec["uid"], group=spec["gid"], extra_groups=spec.get("groups") or [])
        log = open(spec["log_path"], "ab", buffering=0)
        try:
            self.child = subprocess.Popen(
                spec["argv"], cwd=spec["cwd"], env=env, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            why = getattr(e, "strerror", None) or str(e)
            if isinstance(e, OSError) and e.filename == spec["cwd"]:   # chdir failed, not the exec
                reason = f"cannot start {spec['argv'][0]!r}: its working directory {spec['cwd']!r}: {why}"
            else:
                reason = f"cannot start {spec['argv'][0]!r}: {why}"
            log.write(f"[gpuswap] {reason}\n".encode())
            with self.lock:
                self.status["exit"] = {"code": None, "signal": None, "error": reason, "time": time.time()}
            self.write_status()
            return False
        finally:
            log.close()
        with self.lock:
            self.status["job_pid"] = self.child.pid
        self.write_status()
        return True

    def signal_group(self, sig: int) -> None:
        if self.child is None:
            return
        try:
            os.killpg(self.child.pid, sig)
        except ProcessLookupError:
            pass

    # -- control socket ---------------------------------------------------------------------
    def serve(self) -> None:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(channel.socket_address(self.spec["control"]))
        srv.listen(4)
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        allowed = {0, os.geteuid(), self.spec["uid"]}
        while True:
            conn, _ = srv.accept()
            if peer_uid(conn) not in allowed:
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            for msg in channel.read_messages(conn):
                self.on_message(conn, msg)
        except OSError:
            pass
        with self.lock:
            if self.conn is conn:
                self.conn = None
                self.status["runtime"]["connected"] = False
        self.write_status()

    def on_message(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        op = msg["op"]
        with self.lock:
            rt = self.status["runtime"]
            if op == "hello":   # sent again on every reconnect; `parked` says it is still parked in RAM
                self.conn = conn
                self.sent = None
                rt.update(connected=True, attached=True, state="paused" if msg.get("parked") else "running",
                          pid=msg.get("pid"), restored_step=msg.get("restored_step"),
                          restored_bytes=msg.get("restored_bytes"), restore_s=msg.get("restore_s"),
                          restore_note=_text(msg.get("restore_note")))
                if msg.get("parked"):
                    rt["tier"] = "ram"
                else:
                    rt["device_bytes"] = msg.get("device_bytes", 0)
            elif op == "usage":
                rt.update(device_bytes=msg.get("device_bytes", 0), step=msg.get("step"))
            elif op == "paused":
                rt.update(state="paused", tier=msg.get("tier"), bytes=msg.get("bytes", 0),
                          step=msg.get("step"), pause_s=msg.get("seconds"), device_bytes=0)
                self.sent = None
            elif op == "resumed":   # also the answer to a resume that cancelled a pending pause
                rt.update(state="running", tier=None, resume_s=msg.get("seconds"),
                          device_bytes=msg.get("bytes") or rt.get("device_bytes", 0))
                self.sent = None
            elif op == "checkpointed":
                rt.update(state="checkpointed", tier="disk", bytes=msg.get("bytes", 0),
                          step=msg.get("step"), pause_s=msg.get("seconds"), ckpt_path=msg.get("path"))
                self.sent = None
            elif op == "restore_failed":   # no usable checkpoint; the job exits 1 right after
                rt.update(restore_failed=_text(msg.get("message")) or "no usable checkpoint")
            elif op == "error":
                # The request failed; it is not re-sent (a full disk would make that a loop): the
                # daemon sees the error and changes what it wants.
                rt.update(error=str(msg.get("message", ""))[:500], error_at=time.time())
            else:
                return
        self.write_status()
        self.reconcile()

    def send(self, msg: dict[str, Any]) -> bool:
        conn = self.conn
        if conn is None:
            return False
        try:
            conn.sendall(channel.encode(msg))
            return True
        except OSError:
            return False

    # -- reconcile desired vs actual --------------------------------------------------------
    def read_desired(self) -> None:
        path = self.run_dir / "desired.json"
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._desired_mtime:
            self._desired_mtime = mtime
            self.desired = read_json(path) or self.desired

    def reconcile(self) -> None:
        """Level-triggered: compare desired with actual and make the one move that is missing."""
        d = self.desired
        changed = False
        with self.lock:
            if self.child is None or self.status["exit"] is not None:
                return
            if d.get("cancel"):
                if self.term_sent_at is None:
                    self.term_sent_at = time.monotonic()
                    self.signal_group(signal.SIGCONT)
                    self.signal_group(signal.SIGTERM)
                    self.log("cancel: SIGTERM sent to the job's process group")
                elif time.monotonic() - self.term_sent_at > CANCEL_GRACE_S:
                    self.signal_group(signal.SIGKILL)
                return
            want_stop = bool(d.get("sigstop"))
            if want_stop != self.status["stopped"]:
                self.signal_group(signal.SIGSTOP if want_stop else signal.SIGCONT)
                self.log(f"{'SIGSTOP' if want_stop else 'SIGCONT'} sent to the job's process group")
                self.status["stopped"] = want_stop
                changed = True
            rt = self.status["runtime"]
            state = rt.get("state")
            request: Optional[tuple[str, Optional[str]]] = None
            if d.get("run") == "paused" and d.get("tier") in ("ram", "disk"):
                if state == "running" or (state == "paused" and rt.get("tier") == "ram" and d["tier"] == "disk"):
                    request = ("pause", d["tier"])
            elif d.get("run") == "running" and (state == "paused" or (state == "running" and self.sent
                                                                     and self.sent[0] == "pause")):
                # Resume a parked job, or withdraw a pause the job has not reached a safepoint for
                # (the daemon gave up waiting): left pending, it would park the job later anyway.
                request = ("resume", None)
            if request is not None and request != self.sent:
                msg: dict[str, Any] = {"op": request[0]}
                if request[1] is not None:
                    msg["tier"] = request[1]
                if request[1] == "ram" and d.get("max_bytes") is not None:
                    msg["max_bytes"] = d["max_bytes"]
                if self.send(msg):
                    self.sent = request
                    self.log(f"sent {msg}")
        if changed:
            self.write_status()

    # -- main -------------------------------------------------------------------------------
    def run(self) -> int:
        lock_fd = os.open(self.run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)          # held until we exit
        if (self.run_dir / "status.json").exists():
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
        while True:
            try:
                rc = self.child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            self.read_desired()
            self.reconcile()
        self.signal_group(signal.SIGKILL)   # leftovers of the job's session die with it
        sig = -rc if rc < 0 else None
        with self.lock:
            self.status["exit"] = {"code": 128 + sig if sig else rc, "signal": sig, "error": None,
                                   "time": time.time()}
            self.status["runtime"]["connected"] = False
        self.write_status()
        return 0


def _text(value: Any, limit: int = 2000) -> Optional[str]:
    """A job-supplied string, bounded; anything else is None."""
    return value[:limit] if isinstance(value, str) and value else None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpuswap.node.supervisor RUN_DIR", file=sys.stderr)
        return 64
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
