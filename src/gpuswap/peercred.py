"""Who is at the other end of a Unix socket, as the kernel recorded it at connect (SO_PEERCRED):
not the peer's word. The one reader of it, for the API (who is calling), the supervisor (which
process of the job) and a Slurm job's coordinator (which rank)."""
from __future__ import annotations

import socket
import struct
from typing import NamedTuple

_CREDS = struct.Struct("iII")    # struct ucred: pid_t pid, uid_t uid, gid_t gid (uid and gid unsigned)


class Peer(NamedTuple):
    pid: int
    uid: int
    gid: int


def peer(sock: socket.socket) -> Peer:
    """The connected peer of a Unix stream socket (OSError if the socket has none)."""
    return Peer(*_CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)))
