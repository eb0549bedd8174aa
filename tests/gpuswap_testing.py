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
