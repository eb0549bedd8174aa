"""Helpers for tests that drive a real gpuswap daemon (imported by tests/conftest.py and tests)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from gpuswap.api.client import Client, ClientError

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


def has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


class Daemon:
    """A real `gpuswap server` process and a client bound to its home."""

    def __init__(self, home: Path, args: list[str]):
        self.home, self.args = home, args
        self.proc: Optional[subprocess.Popen] = None
        self.client = Client(home, timeout=60)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, GPUSWAP_HOME=str(self.home), PYTHONUNBUFFERED="1")

    def start(self) -> "Daemon":
        log = open(self.home / "daemon.out", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", *self.args],
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.home / "daemon.out").read_text()
            try:
                self.client.get("/v1/health")
                return self
            except ClientError:
                time.sleep(0.05)
        raise AssertionError("daemon did not come up")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cli(self, *args: str, user: Optional[int] = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """The real `gpuswap` CLI in a subprocess (optionally as another uid)."""
        kw: dict[str, Any] = {}
        if user is not None:
            kw.update(user=user, group=user, extra_groups=[], cwd="/tmp")
        return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, **kw)

    def submit(self, argv: list[str], **opts: Any) -> int:
        body = {"argv": argv, "cwd": str(self.home), "env": self.env, **opts}
        return int(self.client.post("/v1/jobs", body)["id"])

    def job(self, job_id: int) -> dict[str, Any]:
        return self.client.get(f"/v1/jobs/{job_id}")

    def until(self, job_id: int, pred: Callable[[dict[str, Any]], bool], timeout: float = 60,
              get: Optional[str] = None) -> dict[str, Any]:
        """Poll job `job_id` (or the record at path `get`) until `pred` holds."""
        deadline = time.monotonic() + timeout
        while True:
            j = self.client.get(get) if get else self.job(job_id)
            if pred(j):
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} stuck: {json.dumps(j, indent=1)}")
            time.sleep(0.1)

    def state(self, job_id: int, *states: str, timeout: float = 60) -> dict[str, Any]:
        return self.until(job_id, lambda j: j["state"] in states, timeout)


def train_cmd(out: Path, steps: int = 200, step_time: float = 0.02, hidden: int = 64) -> list[str]:
    return [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps), "--step-time", str(step_time),
            "--out", str(out), "--hidden", str(hidden)]


def ensure_user(name: str) -> tuple[int, int]:
    """(uid, gid) of an ordinary local user, created (no home, no login shell) if absent. Root only."""
    import pwd

    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", name],
                       check=False, capture_output=True)   # a parallel worker may have made it first
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


class AsUser:
    """Runs code as another uid in a forked child (the interpreter lives under /root, which an
    ordinary user cannot exec), so the kernel and the daemon see that user's real credentials."""

    def __init__(self, uid: int, gid: int):
        self.uid, self.gid = uid, gid

    def call(self, fn: Callable[[], Any], cwd: str = "/") -> Any:
        """fn() as the user, in `cwd` (entered as the user); its result must be JSON-able. An
        exception is returned as {"error": type name, "errno": ..., "message": ...}."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(self.gid)
                os.setuid(self.uid)
                os.chdir(cwd)
                out = json.dumps({"ok": fn()})
            except BaseException as e:   # report anything to the parent
                out = json.dumps({"error": type(e).__name__, "errno": getattr(e, "errno", None),
                                  "message": str(e)})
            os.write(w, out.encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        res = json.loads(data)
        return res["ok"] if "ok" in res else res

    def api(self, home: Path, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
        """One raw API request as the user: (status code, JSON body)."""
        import httpx

        def run() -> list[Any]:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")),
                              base_url="http://x", timeout=60) as c:
                r = c.request(method, path, json=body)
                return [r.status_code, r.json()]

        res = self.call(run)
        assert isinstance(res, list), res
        return res[0], res[1]

    def cli(self, home: Path, *args: str, cwd: str = "/tmp",
            env: Optional[dict[str, str]] = None) -> tuple[int, str, str]:
        """The real CLI (gpuswap.cli.main.main) as the user: (exit code, stdout, stderr)."""
        import io
        import contextlib

        from gpuswap.cli import main as cli_main, render, remote, slurm_wrap, top  # noqa: F401
        # Everything the CLI imports is loaded before the switch (the user cannot read /root).
        cli_main.build_parser()

        def run() -> list[Any]:
            os.environ["GPUSWAP_HOME"] = str(home)
            os.environ.update(env or {})
            out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")   # `logs` writes to .buffer
            err = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = cli_main.main(list(args))
            out.flush()
            return [code, out.buffer.getvalue().decode(errors="replace"), err.getvalue()]

        res = self.call(run, cwd=cwd)
        assert isinstance(res, list), res
        return res[0], res[1], res[2]
