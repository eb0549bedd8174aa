"""The daemon's frontend: the API app and the Unix socket's protocol, handed to node/daemon.py's
`serve` by `gpuswap server` (the node layer does not import this one)."""
from __future__ import annotations

from typing import Any, Optional

from gpuswap.node.daemon import Frontend


def frontend(admin_group: Optional[str]) -> Frontend:
    """The app every daemon serves: its callers told apart by SO_PEERCRED on the Unix socket
    (api/auth.py) or by bearer token on --listen, `admin_group`'s members allowed any job."""
    from gpuswap.api.app import create_app
    from gpuswap.api.auth import Authorizer, PeerCredProtocol
    from gpuswap.api.forwarded import Replayer
    from gpuswap.api.tokens import TokenBook

    def make_app(store: Any, controller: Any, gpus: Any, launcher: Any) -> Any:
        return create_app(store, controller, gpus, launcher, Authorizer(admin_group, TokenBook(store)))

    return Frontend(make_app, PeerCredProtocol, Replayer)
