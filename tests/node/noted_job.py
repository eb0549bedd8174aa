"""A job that speaks the control protocol and answers a pause as the runtime does when a RAM
pause became a disk park (over the RAM budget, or a CUDA graph): `checkpointed` with a `note`,
then exit 75. Started again, it holds until cancelled.

Usage: noted_job.py."""
from __future__ import annotations

import json
import os
import socket
import sys

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.protocol import channel, env

NOTE = "RAM park refused: a CUDA graph or private memory pool holds device memory (test)"


def main() -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(channel.socket_address(os.environ[env.CONTROL]))
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "device_bytes": 1 << 20}))
    for line in channel.read_lines(s):
        if json.loads(line or b"{}").get("op") == "pause":
            s.sendall(channel.encode({"op": "checkpointed", "bytes": 1 << 20, "seconds": 0.01,
                                      "step": 3, "note": NOTE}))
            s.close()
            sys.exit(REQUEUE_EXIT_CODE)


if __name__ == "__main__":
    main()
