"""Who is calling: the Unix socket's peer credentials (SO_PEERCRED), checked by the kernel.

uvicorn does not put peer credentials in the ASGI scope, so a thin subclass of its h11 protocol
reads them once per connection and wraps the app to add them to every request's scope.
"""
from __future__ import annotations

import grp
import os
import pwd
import socket
from dataclasses import dataclass
from typing import Any, Optional

from fastapi import HTTPException, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpuswap import peercred

SCOPE_KEY = "gpuswap.peer"
# The pool node whose socket a forwarded request came in on (api/forwarded.py); absent: this machine.
ORIGIN_KEY = "gpuswap.origin"


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    user: str
    admin: bool

    def may_act_on(self, owner_uid: int) -> bool:
        return self.admin or self.uid == owner_uid


class PeerCredProtocol(H11Protocol):
    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        peer = None
        if sock is not None and sock.family == socket.AF_UNIX:
            peer = tuple(peercred.peer(sock))   # pid, uid, gid
        inner = self.app

        async def app_with_peer(scope: dict, receive: Any, send: Any) -> None:
            scope[SCOPE_KEY] = peer
            await inner(scope, receive, send)

        self.app = app_with_peer


class Authorizer:
    """Maps a peer to a Caller. Admins: root, the daemon's own user, members of `admin_group`."""

    def __init__(self, admin_group: Optional[str], tokens: Optional[Any] = None):
        self.tokens = tokens            # a gpuswap.api.tokens.TokenBook: bearer tokens on the TCP listener
        self.daemon_uid = os.geteuid()
        self.admin_gid: Optional[int] = None
        if admin_group:
            try:
                self.admin_gid = grp.getgrnam(admin_group).gr_gid
            except KeyError:
                self.admin_gid = None

    def caller(self, request: Request) -> Caller:
        peer = request.scope.get(SCOPE_KEY)
        if peer is None:
            return self._token_caller(request)
        _pid, uid, gid = peer
        return self.for_uid(uid, gid)

    def _token_caller(self, request: Request) -> Caller:
        """No kernel-checked peer (TCP): the request must carry a valid `Authorization: Bearer` token."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        owner = self.tokens.verify(token) if self.tokens is not None and scheme.lower() == "bearer" else None
        if owner is None:
            raise HTTPException(401, "unauthenticated: send `Authorization: Bearer TOKEN` (create one with "
                                     "`gpuswap token create`) or connect through the daemon's Unix socket",
                                headers={"WWW-Authenticate": "Bearer"})
        return self.for_uid(owner.uid, None)

    def for_uid(self, uid: int, gid: Optional[int]) -> Caller:
        """The Caller for a uid, with the same admin rule whichever way it authenticated."""
        gid = gid if gid is not None else uid
        try:
            pw = pwd.getpwuid(uid)
            user, gid = pw.pw_name, pw.pw_gid
            groups = os.getgrouplist(user, gid)
        except KeyError:
            user, groups = str(uid), [gid]
        admin = uid in (0, self.daemon_uid) or (self.admin_gid is not None and self.admin_gid in groups)
        return Caller(uid=uid, gid=gid, user=user, admin=admin)
