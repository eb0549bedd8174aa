"""The job's main process, as its supervisor starts and signals it.

The job starts through `execshim.py`, which drops to the user *before* entering the job's
directory, and arms a parent-death signal: if the supervisor dies, the job's main process is
killed with it (the daemon then kills the rest of its session: `sessions.py`). Its pid, the
session id, is in status.json before the user's program runs, so the daemon can always find what
to kill.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Optional

from gpuswap import processes
from gpuswap.node import execshim
from gpuswap.node.statusfile import StatusFile
from gpuswap.protocol.rundir import Spec
from gpuswap.protocol.status import ExitFacts


class JobProcess:
    """The job's main process (`child`, None until started), the leader of its own session."""

    def __init__(self, spec: Spec, files: StatusFile) -> None:
        self.spec, self.files = spec, files
        self.child: Optional[subprocess.Popen] = None

    def start(self) -> bool:
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
        with self.files.lock:
            self.files.status.job_pid = self.child.pid
            self.files.status.job_start_ticks = processes.start_ticks(self.child.pid)
        self.files.write()
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
        with self.files.lock:
            self.files.status.exit = ExitFacts(code=None, signal=None, error=reason, time=time.time())
        self.files.write()
        return False

    @property
    def reaped(self) -> bool:
        """The main process was waited for: its pid, the group's id, may name another's now."""
        return self.child is not None and self.child.returncode is not None

    def signal_group(self, sig: int) -> None:
        if self.child is None or self.reaped:
            return
        try:
            os.killpg(self.child.pid, sig)
        except ProcessLookupError:
            pass
