"""The control channel between a job's runtime and its supervisor.

A Unix stream socket (path in ``$GPUSWAP_CONTROL``) carrying one JSON object per line. The
supervisor is the server: it outlives daemon restarts, so a job parked in RAM never notices the
daemon going away. Messages are small and infrequent; the hot path (`safepoint`) never touches
the socket, it only reads a flag that the runtime's reader thread sets.

runtime -> supervisor
  {"op": "hello", "pid": int, "device_bytes": int, "restored_step": int|null,
   "restored_bytes": int, "restore_s": float|null,   # the checkpoint restored at attach, and its time
   "restore_note": str|null}   # newer checkpoints skipped (and why), or a requested restart from 0
  {"op": "restore_failed", "message": str}
      # checkpoints exist but none is usable and GPUSWAP_RESTART_ON_BAD_CHECKPOINT is not 1: sent on
      # a one-off connection before attach returns; the job then exits 1 (the daemon: FAILED)
  {"op": "usage", "device_bytes": int, "step": int|null}          # periodic, for accounting;
      # device_bytes as measured at the last safepoint (never walked from another thread)
  {"op": "paused", "tier": "ram", "bytes": int, "seconds": float, "step": int}
  {"op": "resumed", "bytes": int, "seconds": float}
  {"op": "checkpointed", "path": str, "bytes": int, "seconds": float, "step": int}
      # then the process exits with gpuswap.jobs.REQUEUE_EXIT_CODE
  {"op": "error", "message": str}                                  # a park failed; job runs on

supervisor -> runtime
  {"op": "pause", "tier": "ram"|"disk", "max_bytes": int?}
      # max_bytes (ram only): what the host-RAM budget has left; a job holding more parks to
      # disk instead (or reports an error if it has no checkpoint directory)
  {"op": "resume"}
"""
from __future__ import annotations

import json
import socket
from typing import Any, Iterator

ENV_JOB_ID = "GPUSWAP_JOB_ID"
ENV_CONTROL = "GPUSWAP_CONTROL"          # control socket path
ENV_CKPT_DIR = "GPUSWAP_CKPT_DIR"        # where disk checkpoints of this job live
ENV_SIMULATED = "GPUSWAP_SIMULATED_GPU"  # "1": no real GPU; attached CPU tensors stand for device memory
ENV_HOME = "GPUSWAP_HOME"

MAX_LINE = 1 << 20


def socket_address(value: str) -> str:
    """`$GPUSWAP_CONTROL` value -> address for socket.connect/bind.

    A leading '@' names a Linux abstract socket (no 108-byte path limit, nothing left on disk);
    the supervisor authorizes peers by SO_PEERCRED, so the namespace being global is harmless.
    """
    return "\0" + value[1:] if value.startswith("@") else value


def encode(msg: dict[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def read_messages(sock: socket.socket) -> Iterator[dict[str, Any]]:
    """Yield messages until the peer closes. Malformed lines are skipped, never fatal."""
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return
        buf += chunk
        if len(buf) > MAX_LINE and b"\n" not in buf:
            buf = b""
            continue
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("op"), str):
                yield msg
