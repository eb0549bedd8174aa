"""An API request made on a pool node's socket, carried to the head and answered there (docs/ray.md).

A node's agent (node/gateway.py) reads the caller's uid and gid from the kernel (SO_PEERCRED) and
queues the request as read; the head takes it through a Ray call, replays it into its own API with
that identity (api/forwarded.py) and hands the answer back the same way. Nothing a client sends can
set the identity: it is a field of this record, filled by the agent from the kernel, never a header.
"""
from __future__ import annotations

from dataclasses import dataclass

# A request is refused past these before it is queued: one body as large as the API accepts
# (api/limits.py MAX_BODY_BYTES, 1 MiB), with room for its headers.
MAX_BODY_BYTES = 1024 * 1024
MAX_HEADERS = 64
MAX_TARGET_CHARS = 8192
# Headers that describe the hop between the client and the agent, not the request: the head's
# replay is a whole request in memory, so it gets none of them (RFC 9110 7.6.1).
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                         "upgrade", "host", "content-length"})


@dataclass(frozen=True)
class ForwardedRequest:
    id: int                     # the agent's own number for it (answered by it)
    uid: int                    # the caller, as the kernel reported it on the node's socket
    gid: int
    pid: int                    # on the node: meaningless at the head, kept for its logs
    method: str
    target: str                 # path and query, as sent
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


@dataclass(frozen=True)
class ForwardedResponse:
    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
