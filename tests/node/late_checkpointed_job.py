"""A job whose "checkpointed" report reaches its supervisor only after its main process has exited.

Usage: late_checkpointed_job.py MARKER HOLDER_SOCKET. First launch (MARKER absent): says hello on
the control socket, hands that connection (SCM_RIGHTS) to the holder listening on HOLDER_SOCKET --
the test process, outside the job, so nothing the supervisor kills at the job's end -- and exits
with REQUEUE_EXIT_CODE at once. The holder waits until the supervisor half-closes the connection
(it does that only once the job's processes are gone and its main process reaped) and only then
sends `checkpointed`: the job's own actions put the exit before the report, whatever the machine's
load. Every later launch (MARKER present) exits 0."""
from __future__ import annotations

import os
import socket
import sys

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.protocol import channel, env


def main() -> int:
    marker, holder = sys.argv[1], sys.argv[2]
    if os.path.exists(marker):
        return 0
    with open(marker, "w"):
        pass
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    channel.connect(s, os.environ[env.CONTROL])
    s.sendall(channel.encode({"op": "hello", "pid": os.getpid(), "device_bytes": 1 << 20}))
    h = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    h.connect(holder)
    socket.send_fds(h, [b"c"], [s.fileno()])
    h.recv(1)                            # the holder has it: this process's copy may go
    os._exit(REQUEUE_EXIT_CODE)


if __name__ == "__main__":
    sys.exit(main())
