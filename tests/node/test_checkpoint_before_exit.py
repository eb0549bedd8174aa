"""A job's `checkpointed` report counts even when its exit is seen first (node/supervisor.py).

The runtime sends `checkpointed` and exits with REQUEUE_EXIT_CODE at once. Nothing orders the
supervisor's reader of that report before its main loop's sight of the exit: when the exit came
first, the job was recorded FAILED ("exited with code 75") and its checkpoint never used. The
job here forces that order (late_checkpointed_job.py): it hands its control connection to this
test process, which sends the report only when the supervisor ends the connection from its side.
A fixed supervisor does that once the job's processes are gone and reaped and before the exit is
recorded; an unfixed one only by exiting, after recording "exited with code 75". Either way the
exit is seen first, on a machine of any load. (The holder is outside the job: the supervisor kills
every process the job leaves behind, orphans included, before it reads what is left.)"""
from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

from gpuswap.protocol import channel

HERE = Path(__file__).resolve().parent


def _hold(server: socket.socket) -> None:
    """Take the job's control connection, read until the supervisor's EOF, then report."""
    server.settimeout(600)
    conn, _ = server.accept()
    with conn:
        _, fds, _, _ = socket.recv_fds(conn, 16, 1)
        conn.sendall(b"k")
    with socket.socket(fileno=fds[0]) as s:
        s.settimeout(600)
        for _ in channel.read_lines(s):
            pass                         # orders, if any: ignored; until the supervisor's EOF
        s.sendall(channel.encode({"op": "checkpointed", "path": "/nonexistent/ckpt", "bytes": 4096,
                                  "seconds": 0.01, "step": 7}))


def test_checkpointed_sent_after_the_exit_is_seen_still_requeues(daemon, home):
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(home / "holder.sock"))
    server.listen(1)
    holder = threading.Thread(target=_hold, args=(server,), daemon=True)
    holder.start()
    job = daemon.submit([sys.executable, str(HERE / "late_checkpointed_job.py"), str(home / "launched"),
                         str(home / "holder.sock")], name="late")
    done = daemon.state(job, "COMPLETED", "FAILED", "CANCELLED")
    reasons = [e["reason"] for e in done["events"]]
    assert any(r.startswith("parked to disk: checkpoint of 4.0 KiB at step 7") and "requeued" in r
               for r in reasons), reasons
    assert done["state"] == "COMPLETED", reasons     # the second launch exits 0
    holder.join(timeout=60)
    server.close()
