"""A job that sends N valid usage reports as fast as it can over its control socket, then one with
step LAST_STEP, writes OUT once all are sent, and holds its GPU until cancelled.

Usage: flood_job.py OUT N"""
from __future__ import annotations

import os
import socket
import sys
import time

from gpuswap.protocol import channel, env

LAST_STEP = 777_777


def main(out: str, n: int) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(channel.socket_address(os.environ[env.CONTROL]))
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "device_bytes": 1 << 30}))
    report = channel.encode({"op": "usage", "device_bytes": 1 << 30, "step": 1})
    for _ in range(n // 1000):
        s.sendall(report * 1000)
    s.sendall(channel.encode({"op": "usage", "device_bytes": 3 << 30, "step": LAST_STEP}))
    with open(out + ".tmp", "w") as f:
        f.write("sent")
    os.rename(out + ".tmp", out)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
