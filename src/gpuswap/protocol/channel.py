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
import select
import socket
import time
from typing import Any, Callable, Iterator, Optional

MAX_LINE = 1 << 20
SEND_WAIT_S = 5.0     # the longest an order may wait for room in a job's socket (send_or_drop)


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


def send_or_drop(conn: socket.socket, data: bytes, log: Callable[[str], None], whose: str) -> bool:
    """Send one order to a job's runtime or rank (`whose`: "the runtime's", "a rank's"), blocking
    at most SEND_WAIT_S in all: the sender (the supervisor) holds the lock every move of the job
    takes. The job's reader thread reads all the time, so a socket that stays too full to take the
    order (a `commit` of many ranks' parts is larger than the socket's buffer: the reader makes
    room at once) means a peer that reads nothing, a broken or hostile job: the connection is shut
    down, our reader of it ends, and it counts as lost (a runtime reconnects; a rank is lost to its
    coordinator). Before, such a peer (thousands of hellos, each answered, none read) blocked the
    send for good, and the job could no longer be cancelled."""
    view = memoryview(data)
    deadline = time.monotonic() + SEND_WAIT_S
    try:
        while view:
            try:
                view = view[conn.send(view, socket.MSG_DONTWAIT):]
            except BlockingIOError:
                left = deadline - time.monotonic()
                poller = select.poll()          # not select(): a descriptor may be above 1023
                poller.register(conn, select.POLLOUT)
                if left <= 0 or not poller.poll(left * 1000):
                    log(f"closed {whose} control connection: it reads nothing of what it is sent")
                    break
        else:
            return True
    except OSError:
        pass          # closed already: its reader sees it
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    return False


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
