"""Test helper: the supervisor's end of the control channel, and demo-job launching.

A protocol peer (JSON lines over a real Unix socket), not a mock of gpuswap code: the runtime
under test talks to it exactly as it would to `gpuswap.node.supervisor`.
"""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gpuswap.protocol import channel
from gpuswap_testing import FACT_TIMEOUT_S

DEMO_STEPS = 150  # steps of every demo run in these tests (one shared baseline)
HELD_TRAIN = Path(__file__).resolve().parents[1] / "held_train.py"


class SupervisorPeer:
    """Listens on an abstract socket; records every message from the job; sends commands."""

    def __init__(self) -> None:
        self.address = f"@gpuswap-rt-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(channel.socket_address(self.address))
        self._server.listen(4)
        self._conn: socket.socket | None = None
        self._connected = threading.Condition()
        self.inbox: "queue.Queue[dict[str, Any]]" = queue.Queue()
        self.log: list[dict[str, Any]] = []
        self.connections = 0
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._connected:
                self._conn = conn
                self.connections += 1
                self._connected.notify_all()
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            for msg in channel.read_messages(conn):
                self.log.append(msg)
                self.inbox.put(msg)
        except OSError:
            pass

    def send(self, msg: dict[str, Any]) -> None:
        with self._connected:
            assert self._connected.wait_for(lambda: self._conn is not None, timeout=FACT_TIMEOUT_S)
            self._conn.sendall(channel.encode(msg))

    def expect(self, op: str, timeout: float = FACT_TIMEOUT_S) -> dict[str, Any]:
        """Next message with this op; 'usage' messages in between are skipped, others fail."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {op!r} within {timeout}s; got so far: {self.log}")
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            if msg["op"] == op:
                return msg
            if msg["op"] != "usage":
                raise AssertionError(f"expected {op!r}, got {msg}")

    def drop(self) -> None:
        """Close the current connection, as a crashing supervisor would."""
        with self._connected:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self.drop()
        self._server.close()


def job_env(peer: SupervisorPeer | None, ckpt_dir: Path | None, control: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    env.update(GPUSWAP_JOB_ID="rt-test", GPUSWAP_SIMULATED_GPU="1", PYTHONUNBUFFERED="1")
    if peer is not None or control:
        env["GPUSWAP_CONTROL"] = control or peer.address
    if ckpt_dir is not None:
        env["GPUSWAP_CKPT_DIR"] = str(ckpt_dir)
    return env


def start_train(out: Path, steps: int, step_time: float, env: dict[str, str] | None,
                gate: Path | None = None) -> subprocess.Popen:
    """The demo training job; with `gate`, held at its safepoints from step steps - 2 until the test
    creates that file (tests/held_train.py), so it cannot end before the test's messages reach it."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    program = [str(HELD_TRAIN), str(gate), str(steps - 2)] if gate else ["-m", "gpuswap.demo.train"]
    cmd = [sys.executable, *program, "--steps", str(steps),
           "--step-time", str(step_time), "--out", str(out), "--log-every", "1000"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = FACT_TIMEOUT_S) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def pause_in_background(job: Any, check: Any, step: int = 7) -> dict[str, Any]:
    """Park in RAM at the safepoint the calling thread is about to enter, run `check` while the job
    is parked, then resume: the pause is driven from another thread as the runtime's control
    thread would. `safepoint` returns only after the resume, so `check`'s result is in by then."""
    seen: dict[str, Any] = {}

    def drive() -> None:
        job.request_pause("ram")
        while not job.parked:
            time.sleep(0.001)
        seen.update(check())
        job.request_resume()

    t = threading.Thread(target=drive)
    t.start()
    while job._phase == "running" and not job._pending:
        time.sleep(0.001)
    job.safepoint(step)
    t.join()
    return seen
