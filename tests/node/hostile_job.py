"""A job that attacks its own control socket: sends hostile messages, then one good one.

Usage: hostile_job.py OUT_JSON. It connects to $GPUSWAP_CONTROL exactly as the runtime does,
says hello, sends every shape in HOSTILE (one line each, lines over the limit among them), a
valid usage report with step MARK_STEP, and the first hostile line again, last. A second
connection then sends nothing but junk, to see it closed. OUT_JSON records what happened; the
job then sleeps (holding its GPU) until cancelled.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

from gpuswap.protocol import channel, env

MARK_STEP = 4242
HUGE = str(10**30)
HOSTILE: list[bytes] = [
    b'{"op":"usage","device_bytes":' + HUGE.encode() + b',"step":' + HUGE.encode() + b'}',
    b'{"op":"usage","device_bytes":-5,"step":-' + HUGE.encode() + b'}',
    b'{"op":"usage","device_bytes":1e308}',
    b'{"op":"usage","device_bytes":"nan","step":"1e308"}',
    b'{"op":"usage","device_bytes":true,"step":[1]}',
    b'{"op":"hello","pid":' + HUGE.encode() + b',"device_bytes":{"a":1},"restore_s":1e999}',
    b'{"op":"paused","tier":"moon","bytes":' + HUGE.encode() + b',"seconds":NaN,"step":1.5}',
    b'{"op":"resumed","bytes":-1,"seconds":Infinity}',
    b'{"op":"checkpointed","path":"' + b"p" * 100_000 + b'","bytes":' + HUGE.encode() + b'}',
    b'{"op":"error","message":' + b"7" * 5000 + b'}',
    b'{"op":"usage","device_bytes":' + b"9" * 5000 + b'}',
    b'[1,2,3]', b'"usage"', b'42', b'null', b'{}', b'{"op":null}', b'{"op":["usage"]}',
    b'[' * 200_000 + b']' * 200_000,      # deep nesting (and over the line limit)
    b'{"op":"usage","x":' + b'[' * 5000 + b']' * 5000 + b'}',
    b'\xff\xfe\x00garbage',
    b'{"op":"usage","device_bytes":1' + b'0' * (2 << 20) + b'}',   # a 2 MiB line
]


def main(out: str) -> None:
    addr = channel.socket_address(os.environ[env.CONTROL])
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(addr)
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "device_bytes": 1 << 30}))
    for line in HOSTILE:
        s.sendall(line + b"\n")
    s.sendall(channel.encode({"op": "usage", "device_bytes": 2 << 30, "step": MARK_STEP}))
    s.sendall(HOSTILE[0] + b"\n")     # the attack of issue 10, left standing as the last word

    junk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    junk.connect(addr)
    junk.settimeout(120)
    closed = False
    try:
        for _ in range(1000):
            junk.sendall(b'{"op":"usage","device_bytes":-1}\n')
        closed = junk.recv(1) == b""
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    except TimeoutError:
        closed = False
    with open(out + ".tmp", "w") as f:
        json.dump({"sent": len(HOSTILE), "junk_connection_closed": closed}, f)
    os.rename(out + ".tmp", out)
    while True:        # keep the good connection open and the GPU held until cancelled
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1])
