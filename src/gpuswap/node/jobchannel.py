"""The job's end of the control channel, as its supervisor serves it: the socket, and what each
message from the job's runtime changes.

The supervisor is the server: it outlives daemon restarts, so a job parked in RAM never notices
the daemon going away. The socket is a path in the run directory (only the daemon can make
entries there), the job owner's file, mode 0600, and every peer's uid is checked as well
(SO_PEERCRED). Every line goes through the gate (protocol/messages.py): a bad one is ignored and
counted, and a connection that sends MAX_BAD of them is closed with one log line. So is one that
does not take an order within SEND_WAIT_S (`channel.send_or_drop`): a job that reads nothing must
not hold up its supervisor, which sends under the lock every move of the job takes.

A single-rank job's messages are folded into status.json's `runtime` here; a multi-rank job's
(its first hello says world_size > 1) go to its ranks' coordinator (runtime/ranktable.py), whose
facts replace them.

When the job has ended, `drain` folds what its connections still carry before the supervisor
records the exit: the runtime sends `checkpointed` and exits at once, and a reader thread that
had not got to that line yet when the exit was seen left the job FAILED instead of requeued.
"""
from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Callable, Optional

from gpuswap import peercred, processes
from gpuswap.node import sessions
from gpuswap.node.statusfile import StatusFile
from gpuswap.protocol import channel, messages, records
from gpuswap.protocol.rundir import Desired, Spec
from gpuswap.runtime.ranktable import RankTable

MAX_BAD = 64          # invalid control messages one connection may send before it is closed
# Open control connections beyond what the job can use (one for a single-rank job's runtime, one
# per rank: the job's GPUs, or the world size its ranks said) are closed at once: each is served by
# a thread of this root process, and a job that opened thousands could use up the machine's pids.
SPARE_CONNS = 16


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the peer, as the kernel recorded them at connect (not the job's word)."""
    p = peercred.peer(sock)
    return p.pid, p.uid


class JobChannel:
    """The control socket of one launch. `conn`: the single-rank runtime's connection; `sent`: the
    last request sent on it; `ranks`: a multi-rank job's connections and coordinator (None until
    a rank says hello). Changed under the supervisor's lock (`files.lock`).

    `reconcile()`: the supervisor's move after a fact changed; `desired()`: what the daemon wants
    now; `on_kill(reason)`: the coordinator's verdict that a multi-rank job cannot go on."""

    def __init__(self, spec: Spec, files: StatusFile, reconcile: Callable[[], None],
                 desired: Callable[[], Desired], on_kill: Callable[[str], None]) -> None:
        self.spec, self.files = spec, files
        self._reconcile, self._desired, self._on_kill = reconcile, desired, on_kill
        self.conn: Optional[socket.socket] = None
        self.sent: Optional[tuple[str, Optional[str]]] = None
        self.ranks: Optional[RankTable] = None
        self._conns_lock = threading.Lock()
        self._served: set[socket.socket] = set()     # control connections being served
        self._all_done = threading.Condition(self._conns_lock)   # notified as each one ends
        self._accepting = threading.Lock()  # held from an accept until its connection is registered
        self._draining = False          # the job has ended: no more orders go out (`drain`)
        self._srv: Optional[socket.socket] = None

    # -- the socket ---------------------------------------------------------------------------
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
        srv.setblocking(False)         # taken by `_take_waiting`, from the accept thread or `drain`
        self._srv = srv
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self._srv is not None
        waiting = select.poll()
        waiting.register(self._srv, select.POLLIN)
        while True:
            waiting.poll()
            if not self._take_waiting():
                time.sleep(0.1)        # out of fds or memory: try again, without spinning

    def _take_waiting(self) -> bool:
        """Accept and register every connection waiting on the socket. Under `_accepting`, so a
        connection is never out of the backlog and not yet in `_served` while `drain` looks.
        False: an accept failed for want of resources (the connection stays waiting)."""
        assert self._srv is not None
        with self._accepting:
            while True:
                try:
                    conn, _ = self._srv.accept()
                except (BlockingIOError, InterruptedError):
                    return True
                except OSError:
                    return False
                conn.setblocking(True)
                self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        allowed = {0, os.geteuid(), self.spec.uid}
        pid, uid = peer_cred(conn)
        # The connecting process's start time, now: with its pid it names that process for good
        # (ranktable.py). One already gone (or in another pid namespace) leaves none: such a
        # process is never recorded as a rank's, so never killed.
        ticks = processes.start_ticks(pid) if pid else None
        if uid not in allowed:
            conn.close()
            return
        with self._conns_lock:
            over = len(self._served) >= self._conn_limit()
            if not over:
                self._served.add(conn)
                if self._draining:
                    _half_close(conn)
        if over:
            conn.close()
            self.files.log_limited(f"closed a control connection (pid {pid}): {self._conn_limit()} "
                                   "are open, more than this job can use")
            return
        threading.Thread(target=self._read, args=(conn, pid, ticks), daemon=True).start()

    def drain(self, timeout_s: float) -> int:
        """Once every process of the job is gone: fold all its connections carry, to their end,
        before the exit is recorded. Every connection is half-closed first (no order will come
        any more), and each ends when no process holds its other end: those of the job's session
        and of its ranks are dead already, so only one that left the session (setsid) can keep
        us waiting, at most `timeout_s`. Returns how many are still open then."""
        self._take_waiting()               # made before the job died, not accepted yet
        deadline = time.monotonic() + timeout_s
        with self._conns_lock:
            self._draining = True
            for conn in self._served:
                _half_close(conn)
            while self._served and (left := deadline - time.monotonic()) > 0:
                self._all_done.wait(left)
            return len(self._served)

    def _conn_limit(self) -> int:
        gpus = self.spec.extra_env.get("CUDA_VISIBLE_DEVICES", "")
        world = self.ranks.coord.world_size if self.ranks is not None else 0
        return SPARE_CONNS + max(len([g for g in gpus.split(",") if g.strip()]), world or 0)

    def _read(self, conn: socket.socket, peer_pid: Optional[int] = None, peer_ticks: Optional[int] = None) -> None:
        """Serve one connection. Every line is validated (messages.py): a bad one is ignored and
        counted, and a connection that sends MAX_BAD of them is closed with one log line."""
        try:
            self._serve_conn(conn, peer_pid, peer_ticks)
        finally:
            with self._conns_lock:
                self._served.discard(conn)
                self._all_done.notify_all()

    def _serve_conn(self, conn: socket.socket, peer_pid: Optional[int], peer_ticks: Optional[int]) -> None:
        files, bad = self.files, 0
        try:
            for line in channel.read_lines(conn, messages.MAX_LINE):
                try:
                    if line is None:
                        raise messages.BadMessage(f"line longer than {messages.MAX_LINE} bytes")
                    msg = messages.parse(line)
                except messages.BadMessage as e:
                    bad += 1
                    with files.lock:
                        rt = files.status.runtime
                        rt["rejected"] = rt.get("rejected", 0) + 1
                        files.hold_back()
                    if bad == 1:
                        files.log_limited(f"ignored an invalid control message ({e}); further ones are counted")
                    if bad >= MAX_BAD:
                        files.log_limited(f"closed a control connection after {bad} invalid messages")
                        break
                    continue
                if not self.on_message(conn, msg, peer_pid, peer_ticks):
                    break
        except OSError:
            pass
        conn.close()
        with files.lock:
            if self.conn is conn:
                self.conn = None
                files.status.runtime["connected"] = False
            if self.ranks is not None:
                self.ranks.lost(conn, time.time())
                self.rank_facts()
        files.write_for_job()

    def send(self, msg: records.Order) -> bool:
        """A request to the single-rank runtime; False if it is not connected, or reads nothing
        (then its connection is closed: `channel.send_or_drop`)."""
        conn = self.conn
        if conn is None:
            return False
        return channel.send_or_drop(conn, records.encode(msg), self.files.log_paced, "the runtime's")

    # -- what a message changes ---------------------------------------------------------------
    def on_message(self, conn: socket.socket, msg: records.Report, peer_pid: Optional[int] = None,
                   peer_ticks: Optional[int] = None) -> bool:
        """Fold one message into status and reconcile; False: close this connection."""
        if self.ranks is not None or (isinstance(msg, records.Hello) and (msg.world_size or 1) > 1):
            return self._on_rank_message(conn, msg, peer_pid, peer_ticks)
        files = self.files
        with files.lock:
            rt = files.status.runtime
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
                files.hold_back()       # folded into the next write (USAGE_WRITE_S): nothing to reconcile
                if not files.due():
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
        files.write_for_job()
        self._reconcile()
        return True

    def _on_rank_message(self, conn: socket.socket, msg: records.Report, peer_pid: Optional[int],
                         peer_ticks: Optional[int]) -> bool:
        files, now = self.files, time.time()
        with files.lock:
            if self.ranks is None:
                self.ranks = RankTable(self.spec.pause_timeout_s, self._on_kill, files.log,
                                       uid=sessions.job_uid(self.spec.uid))
                files.log(f"multi-rank job: {msg.world_size if isinstance(msg, records.Hello) else '?'} ranks")
            if isinstance(msg, records.Hello):
                if (msg.world_size or 1) == 1 or not self.ranks.hello(conn, msg, peer_pid, now, peer_ticks):
                    files.log_limited(f"refused a control connection (pid {peer_pid}): rank {msg.rank} of "
                                      f"{msg.world_size or 1} in a job of {self.ranks.coord.world_size} ranks, "
                                      "or a rank already connected")
                    self.rank_facts()
                    return False
                self.ranks.want(self._desired(), now)
            elif isinstance(msg, records.Usage):
                self.ranks.receive(conn, msg, now)
                files.hold_back()
                if not files.due():
                    return True
            elif isinstance(msg, records.RestoreFailed):
                files.status.runtime["restore_failed"] = msg.message
            else:
                self.ranks.receive(conn, msg, now)
            self.rank_facts()
        files.write_for_job()
        return True

    def rank_facts(self) -> None:
        """status.json from the coordinator (under the lock): the job's facts, and the ranks'
        processes, which the daemon kills if this supervisor dies."""
        assert self.ranks is not None
        status = self.files.status
        old = status.runtime
        rt = self.ranks.facts()
        for keep in ("rejected", "restore_failed"):
            if keep in old:
                rt[keep] = old[keep]
        status.runtime = rt
        status.rank_pids = self.ranks.pid_records()


def _half_close(conn: socket.socket) -> None:
    """No more orders on `conn`: its peer reads its end; what it sends is still read."""
    try:
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
