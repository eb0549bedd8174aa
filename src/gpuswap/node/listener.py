"""`gpuswap server --listen HOST:PORT`: the same API on TCP, for browsers and remote CLIs.

There is no kernel-checked peer on TCP, so every request must carry a bearer token (see
api/tokens.py); the app is the very same object as on the Unix socket, so the authorization
rules are too. We bind the socket ourselves, before anything else starts, so that a taken port or
a bad address is one clear line (exit code 1; 64 for one that cannot be read, see
node/settings.py) rather than a uvicorn traceback in a thread.
"""
from __future__ import annotations

import socket
import threading
from typing import Any, Optional


class ListenError(Exception):
    """A --listen address that cannot be parsed or bound."""


def parse_listen(spec: str, name: str = "--listen") -> tuple[str, int]:
    """'127.0.0.1:8080' / '[::1]:8080' / ':8080' (all interfaces) -> (host, port). `name` is how
    the error names the setting: the flag, or the config file's key."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ListenError(f"cannot read {name} {spec!r}; write HOST:PORT, e.g. 127.0.0.1:8080")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "0.0.0.0", int(port)


def bind(spec: str) -> socket.socket:
    host, port = parse_listen(spec)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        sock = socket.create_server((host, port), family=family, backlog=128)
    except (OSError, IndexError) as e:
        raise ListenError(f"cannot listen on {spec}: {getattr(e, 'strerror', None) or e}") from None
    sock.set_inheritable(False)
    return sock


def public_url(sock: socket.socket) -> str:
    """The http:// URL people should use for this socket (the host's name for a wildcard bind)."""
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = socket.getfqdn()
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class TcpListener:
    """A second uvicorn server (plain h11) on its own thread and event loop, serving `app`."""

    def __init__(self, app: Any, sock: socket.socket, guard: Any):
        import uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol

        from gpuswap.node.conn_guard import guarded, server_limits

        self.sock = sock
        # `guard` (a conn_guard.ConnectionGuard): connections within the fd budget, idle ones closed.
        self.server = uvicorn.Server(uvicorn.Config(app, http=guarded(H11Protocol, guard), lifespan="off",
                                                    log_level="warning", access_log=False, proxy_headers=False,
                                                    timeout_graceful_shutdown=2, **server_limits(guard)))
        # proxy_headers=False: uvicorn would take X-Forwarded-Proto/-For from a peer on 127.0.0.1 as
        # the request's scheme and client; nothing here sits behind a proxy it could trust.
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        # Not the main thread: uvicorn leaves signal handling to the Unix-socket server there.
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="tcp-listener", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=5)
        self.sock.close()
