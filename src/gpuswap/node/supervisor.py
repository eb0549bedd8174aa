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

This module is the supervisor's decisions: compare what the daemon wants with what is, and make
the one move that is missing (level-triggered), then collect the job's end. Its parts: the job's
process (jobprocess.py), the control channel and what its messages change (jobchannel.py), and
status.json with supervisor.log (statusfile.py).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from gpuswap import processes
from gpuswap.exitcodes import EX_USAGE
from gpuswap.node import sessions
from gpuswap.node.jobchannel import JobChannel
from gpuswap.node.jobprocess import JobProcess
from gpuswap.node.statusfile import StatusFile
from gpuswap.protocol import records, rundir
from gpuswap.protocol.rundir import Desired, Spec
from gpuswap.protocol.status import ExitFacts, SupervisorStatus
from gpuswap.runtime.ranktable import RankTable

CANCEL_GRACE_S = 10.0
POLL_S = 0.05
# How long the exit waits, once every process of the job is gone, for control connections still
# held open by a process that left its session (setsid): what they send until then still counts.
DRAIN_S = 5.0
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make every process the job starts, once orphaned, a child of this supervisor instead of
    init's: torchrun's workers lead sessions of their own, so when the launcher dies first (killed
    after the cancel grace while a worker takes its time over SIGTERM, the OOM killer) they leave
    the job's session and its process tree both, and a worker that never said hello to the
    coordinator was known to nobody; they ran on, on GPUs given to the next job."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main_exited(main: int) -> bool:
    """Whether the job's main process has exited (left unreaped: see `Supervisor.run`). Adopted
    orphans that exited are reaped on the way, so that none stays a zombie of ours."""
    while True:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return False
        if info.si_pid == main:
            return True
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            pass


def kill_adopted(main: int, uid: Optional[int] = None) -> int:
    """SIGKILL every child of ours other than the job's main process: what the job started and left
    behind (`become_subreaper`); zombies among them are reaped. A child's pid cannot be reused
    before we reap it, so the pid names it. With `uid` (the job's), one that uid could not signal
    itself is left alone, as in `processes.kill_each`. Returns how many were alive (0: none left)."""
    me, left = os.getpid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == main:
            continue
        pid = int(name)
        if processes.parent(pid) != me:
            continue
        st = processes.stat(pid)
        if st is not None and st[0] not in ("Z", "X") and (uid is None or processes.owned_by(pid, uid)):
            left += 1
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return left


class Supervisor:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.spec: Spec = rundir.read_spec(run_dir)
        self.lock = threading.RLock()
        self.status = SupervisorStatus(job_id=self.spec.job_id, generation=self.spec.generation,
                                       supervisor_pid=os.getpid(), started_at=time.time())
        self.files = StatusFile(run_dir, self.status, self.lock)
        self.job = JobProcess(self.spec, self.files)
        self.channel = JobChannel(self.spec, self.files, self.reconcile, lambda: self.desired, self._kill_ranks)
        self.term_sent_at: Optional[float] = None
        self._desired_version: Optional[tuple[int, int, int]] = None    # the desired.json last read
        self._desired_refused: Optional[tuple[int, int, int]] = None    # ... and the last one ignored
        self.desired = Desired()
        self._ended_checkpointed = False
        self.kill_reason: Optional[str] = None

    @property
    def ranks(self) -> Optional[RankTable]:
        """A multi-rank job's connections and coordinator, once a rank said hello; else None."""
        return self.channel.ranks

    def log(self, text: str) -> None:
        self.files.log(text)

    # -- multi-rank jobs ---------------------------------------------------------------------
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
        self.job.signal_group(signal.SIGTERM)
        self.ranks.kill_all()

    def _kill_rank_processes(self) -> int:
        with self.lock:
            return self.ranks.kill_all() if self.ranks is not None else 0

    def _kill_ranks(self, reason: str) -> None:
        """The coordinator's `Kill`: the job cannot go on. The launcher's process group gets SIGTERM
        (torchrun forwards it), every rank process SIGKILL: they are outside our session."""
        if self.kill_reason is None:
            self.kill_reason = reason
        self.job.signal_group(signal.SIGTERM)
        if self.ranks is not None:
            self.ranks.kill_all()

    # -- reconcile desired vs actual --------------------------------------------------------
    def read_desired(self) -> None:
        """The daemon's wish, when desired.json changed. Anything that is not the daemon's record
        (a directory, a FIFO, garbage, a huge file, a field of the wrong type, the file gone) is no
        new wish: the job is left as it is, with one line in supervisor.log per such version of
        the file, which is read again at every poll until it is usable. Never raises: this
        process holds a user's job."""
        try:
            st = os.lstat(self.run_dir / rundir.DESIRED)
            # Each write is a new file (atomic rename): its inode tells two writes apart within the
            # filesystem's timestamp granularity, which the mtime alone does not.
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            version = (0, 0, -1)          # absent: load_desired says so, once
        if version == self._desired_version:
            return
        try:
            desired = rundir.load_desired(self.run_dir)
        except (OSError, ValueError) as e:
            if version != self._desired_refused:
                self._desired_refused = version
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                self.log(f"ignored desired.json ({why[:200]}): no new wish, the job is left as it is")
            return
        self._desired_version, self.desired = version, desired

    def reconcile(self) -> None:
        """Level-triggered: compare desired with actual and make the one move that is missing."""
        d = self.desired
        changed = False
        with self.lock:
            if self.job.child is None or self.job.reaped or self.status.exit is not None:
                return      # reaped: nothing of the job is left to move (its pid may be reused)
            if d.cancel:
                if self.term_sent_at is None:
                    self.term_sent_at = time.monotonic()
                    self.job.signal_group(signal.SIGCONT)
                    self.job.signal_group(signal.SIGTERM)
                    self.log("cancel: SIGTERM sent to the job's process group")
                elif time.monotonic() - self.term_sent_at > CANCEL_GRACE_S:
                    self.job.signal_group(signal.SIGKILL)
                return
            want_stop = d.sigstop
            if want_stop != self.status.stopped:
                self.job.signal_group(signal.SIGSTOP if want_stop else signal.SIGCONT)
                self.log(f"{'SIGSTOP' if want_stop else 'SIGCONT'} sent to the job's process group")
                self.status.stopped = want_stop
                changed = True
            if self.ranks is not None:    # the coordinator answers the daemon for every rank
                now = time.time()
                before = self.ranks.facts()
                self.ranks.want(d, now)
                self.ranks.poll(now)
                if self.ranks.facts() != before:
                    self.channel.rank_facts()
                    changed = True
                self._end_checkpointed()
        if self.ranks is not None:
            if changed:
                self.files.write()
            return
        with self.lock:
            rt = self.status.runtime
            state = rt.get("state")
            sent = self.channel.sent
            request: Optional[tuple[str, Optional[str]]] = None
            if d.pause_tier is not None:
                if state == "running" or (state == "paused" and rt.get("tier") == "ram" and d.pause_tier == "disk"):
                    request = ("pause", d.pause_tier)
            elif d.run == "running" and (state == "paused" or (state == "running" and sent
                                                                     and sent[0] == "pause")):
                # Resume a parked job, or withdraw a pause the job has not reached a safepoint for
                # (the daemon gave up waiting): left pending, it would park the job later anyway.
                request = ("resume", None)
            if request is not None and request != sent:
                msg: records.Order = (records.Pause(tier=request[1], max_bytes=d.max_bytes if request[1] == "ram" else None)
                                      if request[1] is not None else records.Resume())
                if self.channel.send(msg):
                    self.channel.sent = request
                    self.files.log_paced(f"sent {records.wire(msg)}")   # a job's hellos cause these
        if changed:
            self.files.write()

    def _write_held_back(self) -> None:
        """The write that changes held back wait for (statusfile.py `due`). A multi-rank job's
        usage reports are held back in its coordinator, not in status: their facts are taken now.
        Written without them, a rank 0 whose reports all came within USAGE_WRITE_S of the last
        write (a GPUSWAP_USAGE_INTERVAL_S of 0.25 s) had its step missing from status.json until
        one of them happened to come just after that interval, ~25 s later."""
        with self.lock:
            if self.ranks is not None:
                self.channel.rank_facts()
            self.files.write()

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
        if not become_subreaper():
            self.log("cannot become the subreaper of the job's processes: an orphaned process outside "
                     "the job's session may outlive it")
        self.read_desired()
        self.channel.serve()
        if not self.job.start():
            return 0
        assert self.job.child is not None
        pid = self.job.child.pid
        # Wait without reaping: while the exited main process is a zombie its pid (the session id)
        # cannot be reused, so the leftovers of its session are killed by an id that is still theirs.
        while not main_exited(pid):
            time.sleep(POLL_S)
            self.read_desired()
            self.reconcile()
            if self.files.due():
                self._write_held_back()
        ended = self._ranks_verdict()   # before its ranks are killed: where the job stood
        # Until none is left, in its session, among its ranks or among the orphans it left us
        # (torchrun's workers lead sessions of their own): its GPUs are free only then.
        uid = sessions.job_uid(self.spec.uid)
        while (sessions.kill(pid, self.status.job_start_ticks, uid) + self._kill_rank_processes()
               + kill_adopted(pid, uid)):
            time.sleep(POLL_S)
        with self.lock:       # a reader thread's reconcile sees it reaped, or signals before
            rc = self.job.child.wait()
        # Everything the job said before it ended counts, before its end does: a runtime's
        # `checkpointed` followed at once by its exit (code 75) is a requeue, whichever of the two
        # this process noticed first. Its processes are all gone, so its connections end now.
        left = self.channel.drain(DRAIN_S)
        if left:
            self.log(f"{left} control connection(s) still open {DRAIN_S:g} s after the job ended (held by "
                     "a process outside its session): its exit is recorded without what they may send")
        sig = -rc if rc < 0 else None
        error = None
        if ended is not None:
            how = f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() else \
                f"signal {sig}" if sig else f"code {rc}"
            error = f"{ended} (main process: {how})"
        with self.lock:
            if self.ranks is not None:      # what the ranks said since the last write (`_write_held_back`)
                self.channel.rank_facts()
            self.status.exit = ExitFacts(code=128 + sig if sig else rc, signal=sig, error=error, time=time.time())
            self.status.runtime["connected"] = False
        while not self.files.write():   # the exit status must land; wait for room on the disk
            time.sleep(1.0)
        return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gpuswap.node.supervisor RUN_DIR", file=sys.stderr)
        return EX_USAGE
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
