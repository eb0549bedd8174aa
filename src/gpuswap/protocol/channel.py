"""The control channel between a job's runtime and its supervisor.

A Unix stream socket (path in ``$GPUSWAP_CONTROL``) carrying one JSON object per line. The
socket is a file in the job's run directory, a directory only the daemon can create entries in,
and the file is the job owner's with mode 0600: no other user can claim its name or connect to it
(the supervisor also checks the peer's uid, SO_PEERCRED). The
supervisor is the server: it outlives daemon restarts, so a job parked in RAM never notices the
daemon going away. Messages are small and infrequent; the hot path (`safepoint`) never touches
the socket, it only reads a flag that the runtime's reader thread sets.

The messages are typed in records.py, their one definition: what the runtime sends (hello,
usage, paused, resumed, checkpointed, error, restore_failed; a rank of a multi-rank job also mark,
hold, ready, unparked, part, committed, done), validated by messages.py where the supervisor
receives them, and what it is told: the supervisor's pause and resume, or a multi-rank job's
common-step agreement (pause, target, park, commit, exit, resume, regroup, release:
runtime/agreement.py). This module carries JSON objects and knows none of them.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Iterator, Optional

MAX_LINE = 1 << 20


def socket_address(value: str) -> str:
    """`$GPUSWAP_CONTROL` value -> address for socket.connect/bind.

    A leading '@' names a Linux abstract socket (used by test peers only): abstract names are
    global, so anyone could claim one first; the daemon gives every job a path instead.
    """
    return "\0" + value[1:] if value.startswith("@") else value


# sun_path holds 107 bytes and a NUL; a longer path is reached through an fd of its directory.
_SUN_PATH_MAX = 107


def connect(sock: socket.socket, address: str) -> None:
    """`sock.connect` to a control address: a path of any length, or an '@' abstract name."""
    _through_dir(sock.connect, address)


def bind(sock: socket.socket, address: str) -> None:
    _through_dir(sock.bind, address)


def _through_dir(op: Any, address: str) -> None:
    target = socket_address(address)
    if target.startswith("\0") or len(os.fsencode(target)) <= _SUN_PATH_MAX:
        op(target)
        return
    parent, name = os.path.split(target)
    fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        op(f"/proc/self/fd/{fd}/{name}")   # the kernel resolves the directory from the fd
    finally:
        os.close(fd)


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def read_lines(sock: socket.socket, max_line: int = MAX_LINE) -> Iterator[Optional[bytes]]:
    """Yield each line (without its newline) until the peer closes; None for a line longer than
    `max_line`, which is dropped whole (its tail is never taken for a line of its own)."""
    buf, skipping = b"", False
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return
        buf += chunk
        while (nl := buf.find(b"\n")) >= 0:
            line, buf = buf[:nl], buf[nl + 1:]
            if skipping:
                skipping = False          # the end of an over-long line
            elif len(line) > max_line:
                yield None
            else:
                yield line
        if len(buf) > max_line and not skipping:
            skipping = True
            yield None
        if skipping:
            buf = b""


def read_messages(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """Yield messages until the peer closes. Malformed lines are skipped, never fatal."""
    for line in read_lines(sock):
        if line is None:
            continue
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):   # RecursionError: deeply nested JSON
            continue
        if isinstance(msg, dict) and isinstance(msg.get("op"), str):
            yield msg
