"""The job's end of the control channel: a reader thread and a usage heartbeat.

The reader turns `pause`/`resume` into calls on the job (which only set flags and an event);
the hot path never touches the socket. If the supervisor's socket is absent or drops, training
goes on: one line goes to stderr and the reader keeps reconnecting in the background, saying
`hello` again each time it gets through.
"""
from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from typing import Callable, Mapping

from gpuswap.protocol import env as envvars
from gpuswap.protocol import channel, records

USAGE_INTERVAL_S = 2.0
USAGE_INTERVAL_MIN_S, USAGE_INTERVAL_MAX_S = 0.001, 3600.0
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
SEND_TIMEOUT_S = 5.0
PROGRESS_S = 1.0    # a checkpoint being written shows its progress at least this often


def usage_interval(env: Mapping[str, str] = os.environ) -> float:
    """`$GPUSWAP_USAGE_INTERVAL_S` if it is a number of seconds in [0.001, 3600], else the default
    (with one line to stderr: a bad value must not stop training)."""
    text = env.get(envvars.USAGE_INTERVAL_S, "").strip()
    if not text:
        return USAGE_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not USAGE_INTERVAL_MIN_S <= value <= USAGE_INTERVAL_MAX_S:  # also false for nan
        _log(f"ignoring {envvars.USAGE_INTERVAL_S}={text[:40]!r}: not a number of seconds in "
             f"[{USAGE_INTERVAL_MIN_S:g}, {USAGE_INTERVAL_MAX_S:g}]; using {USAGE_INTERVAL_S:g}")
        return USAGE_INTERVAL_S
    return value


class ControlClient:
    """Connects to `$GPUSWAP_CONTROL`; `send` is thread-safe and never raises."""

    def __init__(
        self,
        address: str,
        on_message: Callable[[records.Order], None],
        hello: Callable[[], records.Hello],
        usage: Callable[[], records.Usage],
        progress: Callable[[], int] | None = None,
    ) -> None:
        """`progress`: a counter that moves while a checkpoint is written (bytes written); while
        it moves, usage goes out every `PROGRESS_S` whatever the interval, since the coordinator's
        deadline for a disk park runs from the last progress it saw (runtime/agreement.py)."""
        self._address = address
        self._label = address
        self._on_message = on_message
        self._hello = hello
        self._usage = usage
        self._progress = progress
        self._interval = usage_interval()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._tried = threading.Event()  # the first connection attempt is over, either way
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, wait_s: float = 2.0) -> bool:
        """Start the threads; wait (at most `wait_s`) for the first connection attempt, so that
        `hello` precedes the first step when a supervisor is there. True if connected."""
        for target, name in ((self._read_loop, "gpuswap-control"), (self._usage_loop, "gpuswap-usage")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self._tried.wait(wait_s)
        return self._connected.is_set()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            sock, self._sock = self._sock, None
            self._connected.clear()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: records.Report) -> bool:
        """Send one message if connected. A failed send drops the connection (the reader
        reconnects); the caller goes on either way."""
        return self._send_built(lambda: msg)

    def _send_built(self, build: Callable[[], records.Report]) -> bool:
        """Build the message and send it under one hold of the send lock. A report built from
        the job's state (the usage heartbeat) is then never sent after a later report of
        another state: a usage built just before a park and sent after its `paused` told the
        supervisor that a parked job held its device memory again."""
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            data = records.encode(build())
            try:
                sock.sendall(data)
                return True
            except OSError:
                self._drop_locked(sock)
                return False

    def _drop_locked(self, sock: socket.socket) -> None:
        if self._sock is sock:
            self._sock = None
            self._connected.clear()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- threads ---------------------------------------------------------------------------
    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sec = int(SEND_TIMEOUT_S)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, 0))
            channel.connect(sock, self._address)
        except OSError:
            sock.close()
            raise
        return sock

    def _read_loop(self) -> None:
        delay = RECONNECT_MIN_S
        complained = False
        while not self._closed.is_set():
            try:
                sock = self._connect()
            except OSError as exc:
                if not complained:
                    _log(f"control socket {self._label} unavailable ({exc.strerror or exc}); "
                         "training continues, retrying in the background")
                    complained = True
                self._tried.set()
                self._closed.wait(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            delay = RECONNECT_MIN_S
            if complained:
                _log(f"control socket {self._label} connected")
                complained = False
            with self._lock:
                self._sock = sock
                try:
                    sock.sendall(records.encode(self._hello()))
                    self._connected.set()
                except OSError:
                    self._drop_locked(sock)
            self._tried.set()
            try:
                for raw in channel.read_messages(sock):
                    msg = records.order(raw)
                    if msg is not None:     # an op this runtime does not know, or a malformed field
                        self._on_message(msg)
            except OSError:
                pass
            with self._lock:
                self._drop_locked(sock)
            sock.close()
            if not self._closed.is_set():
                _log(f"control socket {self._label} closed; training continues, reconnecting")
                complained = True

    def _usage_loop(self) -> None:
        tick = min(self._interval, PROGRESS_S) if self._progress is not None else self._interval
        last_sent, seen = time.monotonic(), self._progress() if self._progress is not None else 0
        while not self._closed.wait(tick):
            moved = False
            if self._progress is not None:
                now_seen = self._progress()
                moved, seen = now_seen != seen, now_seen
            if not moved and time.monotonic() - last_sent < self._interval - tick / 2:   # a wait's jitter
                continue
            last_sent = time.monotonic()
            if self._connected.is_set():
                try:
                    self._send_built(self._usage)
                except Exception:  # racing the training thread (e.g. optimizer state growing)
                    continue


def send_once(address: str, msg: records.Report, timeout_s: float = SEND_TIMEOUT_S) -> bool:
    """One message on a fresh connection, for a process about to exit (no threads started)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(channel.socket_address(address))
            sock.sendall(records.encode(msg))
            sock.shutdown(socket.SHUT_WR)
            sock.recv(1)  # wait for the supervisor to read it and close, or the timeout
        return True
    except OSError:
        return False


def _log(text: str) -> None:
    try:
        print(f"gpuswap[{os.getpid()}]: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
