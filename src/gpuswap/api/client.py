"""The CLI's side of the API: HTTP over the daemon's Unix socket, errors as one-line exceptions.

The Unix socket is spoken with the standard library's http.client: every CLI call starts a new
interpreter, and importing httpx (with what it pulls in where installed: click, rich, pygments,
trio) cost ~0.12 s of CPU per call against ~0.02 s for http.client. Remote access over TCP
($GPUSWAP_URL) keeps httpx, for its TLS trust store and its proxy settings from the environment."""
from __future__ import annotations

import http.client
import json
import os
import re
import select
import socket
import threading
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlencode

from gpuswap.api.sizes import MAX_BODY_BYTES, body_too_large
from gpuswap.exitcodes import EX_FAILURE, EX_UNAVAILABLE, EX_USAGE
from gpuswap.protocol import env as envvars

SYSTEM_HOME = Path("/var/lib/gpuswap")
# What a bearer token may hold (RFC 6750's b64token; gpuswap's own are gst_ID_SECRET): anything
# else could not be sent in a header at all (a newline, a non-ASCII letter).
BEARER = re.compile(r"[A-Za-z0-9._~+/-]+=*")


class ClientError(Exception):
    """A failure to report in one line, with the exit code the CLI should use."""

    def __init__(self, message: str, exit_code: int = EX_FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def default_home() -> Path:
    """$GPUSWAP_HOME; else the machine-wide daemon's home if one serves there; else ~/.gpuswap."""
    if os.environ.get(envvars.HOME):
        return Path(os.environ[envvars.HOME]).expanduser()
    if os.geteuid() == 0 or (SYSTEM_HOME / "gpuswap.sock").exists():
        return SYSTEM_HOME
    return Path.home() / ".gpuswap"


def client_home() -> Path:
    """Where the CLI finds its daemon: default_home(), or on a pool node with no daemon of its own
    its gpuswap agent's socket (docs/ray.md; the agent forwards to the pool's head)."""
    home = default_home()
    if os.environ.get(envvars.HOME) or (home / "gpuswap.sock").exists():
        return home
    node = SYSTEM_HOME / "node"           # node/agent.py's default state directory
    return node if (node / "gpuswap.sock").exists() else home


class Response:
    """An answer read whole: what callers use of httpx.Response (status_code, headers, content,
    text, json()). `headers` is case-insensitive, as HTTP headers are."""

    def __init__(self, status_code: int, headers: Mapping[str, str], content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class _Unavailable(Exception):
    """No daemon took the connection."""


class _Denied(Exception):
    """The kernel refused the connection: the socket, or a directory above it, is not open to us."""


class _Timeout(Exception):
    """The daemon took the connection but did not answer in time."""


class _UnixSocket:
    """HTTP/1.1 over a Unix socket, one kept-alive connection per thread (tests share a client
    between threads). A kept connection the daemon has closed meanwhile (its idle timeout, a
    restart) is found readable before reuse and replaced, as httpcore does; only a GET that
    meets one closed just then is sent again, so nothing that changes state is ever sent twice."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout = str(path), timeout
        self._local = threading.local()

    def _connect(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it is one kept from an earlier request."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None and not _readable(conn.sock):
            return conn, True
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except socket.timeout:
            sock.close()
            raise _Timeout() from None
        except PermissionError:
            sock.close()
            raise _Denied() from None
        except OSError:     # absent, refused, or its listen backlog full (EAGAIN)
            sock.close()
            raise _Unavailable() from None
        conn = http.client.HTTPConnection("gpuswap", timeout=self.timeout)
        conn.sock = sock
        self._local.conn = conn
        return conn, False

    def send(self, method: str, url: str, body: Optional[bytes], headers: dict[str, str]) -> Response:
        conn, kept = self._connect()
        try:
            try:
                conn.request(method, url, body=body, headers=headers)
            except (BrokenPipeError, ConnectionResetError):
                # The daemon may have answered from the headers alone and closed before reading
                # the body (a 413): that answer is waiting to be read, and says why.
                if conn.sock is None or not _readable(conn.sock):
                    raise
            r = conn.getresponse()
            content = r.read()
        except BaseException as e:
            self.close()
            # The daemon closed the kept connection between the check above and the request (its
            # idle timeout): a GET changes nothing, so it goes once more, on a new connection.
            if kept and method == "GET" and isinstance(e, (BrokenPipeError, ConnectionResetError)):
                return self.send(method, url, body, headers)
            raise
        if r.will_close:
            self.close()
        return Response(r.status, r.headers, content)

    def close(self) -> None:
        """Closes this thread's connection (each thread's goes with its thread)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()


def _checked_url(url: str, httpx: Any) -> str:
    """$GPUSWAP_URL if httpx can reach something with it, else a usage error naming it."""
    bad = None
    try:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https"):
            bad = "is not an http:// or https:// URL"
        elif not parsed.host:
            bad = "names no host"
        elif parsed.port is not None and not 0 < parsed.port < 65536:
            bad = f"has port {parsed.port}, which no server can listen on"
    except httpx.InvalidURL as e:
        bad = f"is not a URL ({str(e)[:200]})"
    if bad:
        raise ClientError(f"{envvars.URL}={url[:300]!r} {bad}", EX_USAGE)
    return url


def _readable(sock: socket.socket) -> bool:
    """True if an idle connection has something to read: EOF (the daemon closed it) or stray bytes."""
    poller = select.poll()          # not select(): it fails on descriptors past 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class Client:
    """The Unix socket of `home`; or, with no home given and $GPUSWAP_URL set, TCP with $GPUSWAP_TOKEN."""

    def __init__(self, home: Optional[Path] = None, timeout: float = 60.0):
        self.home = home or client_home()
        self.sock: Any = self.home / "gpuswap.sock"
        url = os.environ.get(envvars.URL, "").strip() if home is None else ""
        self.remote = bool(url)
        self._http: Any = None
        self._uds: Optional[_UnixSocket] = None
        if url:
            import httpx

            self.sock = _checked_url(url, httpx).rstrip("/")
            token = os.environ.get(envvars.TOKEN, "").strip()
            if not token:
                raise ClientError(f"{envvars.URL} is set but {envvars.TOKEN} is not; create a token with "
                                  "`gpuswap token create` on the server", EX_USAGE)
            if not BEARER.fullmatch(token):     # the token is a secret: not echoed
                raise ClientError(f"{envvars.TOKEN} is not a gpuswap token: it holds a character no token has "
                                  "(a space, a newline, a non-ASCII letter); copy it again from "
                                  "`gpuswap token create`", EX_USAGE)
            self._http = httpx.Client(base_url=self.sock, timeout=timeout,
                                      headers={"Authorization": f"Bearer {token}"})
            return
        self._uds = _UnixSocket(self.sock, timeout)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        if self._uds is not None:
            self._uds.close()

    def request(self, method: str, path: str, params: Optional[Mapping[str, Any]] = None,
                json: Any = None) -> Any:
        """The daemon's answer (a Response, or an httpx.Response over TCP); ClientError for no
        answer or an error status."""
        try:
            r = self._send(method, path, params, json)
        except _Unavailable:
            hint = (f"check {envvars.URL}, and that the server runs with --listen" if self.remote
                    else "start one with `gpuswap server`, or set GPUSWAP_HOME")
            raise ClientError(f"no gpuswap daemon is listening on {self.sock} ({hint})", EX_UNAVAILABLE) from None
        except _Denied:      # not "no daemon": one may well listen there; and not worth a retry (1, not 69)
            raise ClientError(f"permission denied on {self.sock}: the daemon's home or socket is not open to "
                              "you (ask its admin, or set GPUSWAP_HOME to your own)", EX_FAILURE) from None
        except _Timeout:
            raise ClientError(f"the gpuswap daemon on {self.sock} did not answer in time", EX_UNAVAILABLE) from None
        except OSError as e:
            raise ClientError(f"lost the connection to the gpuswap daemon: {e}", EX_UNAVAILABLE) from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except (ValueError, AttributeError):
                detail = r.text
            # 503/504: a pool node's agent whose head is away or late, or a node the head cannot reach.
            code = (EX_USAGE if r.status_code in (400, 413, 422) else
                    EX_UNAVAILABLE if r.status_code in (503, 504) else EX_FAILURE)
            raise ClientError(str(detail), code)
        return r

    def _send(self, method: str, path: str, params: Optional[Mapping[str, Any]], body: Any) -> Any:
        data = None if body is None else json.dumps(body).encode()
        if data is not None and len(data) > MAX_BODY_BYTES:
            # Refused here, as the daemon would (413): it would cut the body off mid-send.
            raise ClientError(body_too_large(), EX_USAGE)
        if self._uds is None:
            return self._send_tcp(method, path, params, data)
        url = f"{path}?{urlencode(params)}" if params else path
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            return self._uds.send(method, url, data, headers)
        except socket.timeout:
            raise _Timeout() from None
        except http.client.HTTPException as e:   # a closed connection, a malformed answer
            raise OSError(str(e) or type(e).__name__) from None

    def _send_tcp(self, method: str, path: str, params: Optional[Mapping[str, Any]], data: Optional[bytes]) -> Any:
        import httpx

        kw: dict[str, Any] = {} if params is None else {"params": params}
        if data is not None:
            kw.update(content=data, headers={"Content-Type": "application/json"})
        try:
            return self._http.request(method, path, **kw)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError):
            raise _Unavailable() from None
        except httpx.TimeoutException:
            raise _Timeout() from None
        except httpx.TransportError as e:
            raise OSError(str(e)) from None

    def get(self, path: str, **kw: Any) -> Any:
        return body_of(self.request("GET", path, **kw))

    def post(self, path: str, body: Optional[dict[str, Any]] = None) -> Any:
        return body_of(self.request("POST", path, json=body or {}))

    def delete(self, path: str) -> Any:
        return body_of(self.request("DELETE", path))


def body_of(r: Any) -> Any:
    """A successful answer's JSON. Anything else (a redirect, a proxy's page in front of a remote
    daemon) is a failure said in one line, not a traceback."""
    try:
        return r.json()
    except ValueError:
        raise ClientError(f"the gpuswap daemon answered {r.status_code} with no JSON body", EX_FAILURE) from None
