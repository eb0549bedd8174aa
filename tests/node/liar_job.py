"""A job that speaks the control protocol but lies about its moves: it answers a RAM pause with
"8 GiB parked in 1 microsecond" (8.6 PB/s) and a resume with the same speed.

Usage: liar_job.py. It holds its GPU until cancelled."""
from __future__ import annotations

import json
import os
import socket

from gpuswap.protocol import channel, env

LIE_BYTES = 8 << 30
LIE_SECONDS = 1e-6


def main() -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(channel.socket_address(os.environ[env.CONTROL]))
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "device_bytes": LIE_BYTES}))
    for line in channel.read_lines(s):
        msg = json.loads(line or b"{}")
        if msg.get("op") == "pause":
            s.sendall(channel.encode({"op": "paused", "tier": "ram", "bytes": LIE_BYTES,
                                      "seconds": LIE_SECONDS, "step": 1}))
        elif msg.get("op") == "resume":
            s.sendall(channel.encode({"op": "resumed", "bytes": LIE_BYTES, "seconds": LIE_SECONDS}))


if __name__ == "__main__":
    main()
