"""A job that opens many control connections, then names a rank from a process that is gone.

Usage: conn_flood_job.py DIR N. It connects N times to $GPUSWAP_CONTROL and holds them, waits (on
the fact, at most 120 s) until the supervisor has closed all it will not serve, and writes
DIR/held.json ({"opened": N, "closed": how many the supervisor closed}). Once DIR/go exists it
closes them and, three times, connects from a child that forks a grandchild and exits (reaped)
before the grandchild, holding the inherited connection, says hello as rank 0 of 2: the pid the
kernel recorded for that connection is then the gone child's. DIR/dance.json lists those pids; the
job then waits until cancelled.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
from pathlib import Path

from gpuswap.protocol import channel, env


def write(path: Path, record: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.rename(path.with_suffix(".tmp"), path)


def main(out: Path, n: int) -> None:
    addr = channel.socket_address(os.environ[env.CONTROL])
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(addr)
        conns.append(s)
    closed: set[int] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s for s in conns if s.fileno() not in closed], [], [], 1.0)
        for s in ready:
            if s.recv(1) == b"":
                closed.add(s.fileno())
        if len(closed) >= n - 64 and not ready:
            break            # the supervisor keeps far fewer than 64: all it closes are closed by now
    write(out / "held.json", {"opened": n, "closed": len(closed)})
    while not (out / "go").exists():
        time.sleep(0.2)
    for s in conns:
        s.close()
    gone = []
    for _ in range(3):
        child = os.fork()
        if child == 0:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(addr)
            if os.fork() == 0:
                time.sleep(1.0)                     # its parent is gone and reaped by now
                s.sendall(channel.encode({"op": "hello", "rank": 0, "world_size": 2}))
                time.sleep(1.0)
                os._exit(0)
            os._exit(0)
        os.waitpid(child, 0)
        gone.append(child)
        time.sleep(2.5)
    write(out / "dance.json", {"gone": gone})
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
