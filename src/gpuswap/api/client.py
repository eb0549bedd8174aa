"""The CLI's side of the API: HTTP over the daemon's Unix socket, errors as one-line exceptions."""
from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any, Optional

import httpx

from gpuswap.exitcodes import EX_FAILURE, EX_UNAVAILABLE, EX_USAGE
from gpuswap.protocol import env as envvars

SYSTEM_HOME = Path("/var/lib/gpuswap")


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


class Client:
    """The Unix socket of `home`; or, with no home given and $GPUSWAP_URL set, TCP with $GPUSWAP_TOKEN."""

    def __init__(self, home: Optional[Path] = None, timeout: float = 60.0):
        self.home = home or default_home()
        self.sock: Any = self.home / "gpuswap.sock"
        url = os.environ.get(envvars.URL, "").strip() if home is None else ""
        self.remote = bool(url)
        if url:
            if not url.startswith(("http://", "https://")):
                raise ClientError(f"{envvars.URL}={url!r} is not an http:// URL", EX_USAGE)
            token = os.environ.get(envvars.TOKEN, "").strip()
            if not token:
                raise ClientError(f"{envvars.URL} is set but {envvars.TOKEN} is not; create a token with "
                                  "`gpuswap token create` on the server", EX_USAGE)
            self.sock = url.rstrip("/")
            self._http = httpx.Client(base_url=self.sock, timeout=timeout,
                                      headers={"Authorization": f"Bearer {token}"})
            return
        # A Unix socket carries no TLS, so the transport gets an empty TLS context instead of the
        # default one, whose CA bundle took 0.15 s of every CLI call to load (and would verify nothing).
        uds = httpx.HTTPTransport(uds=str(self.sock), verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))
        self._http = httpx.Client(transport=uds, base_url="http://gpuswap", timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError):
            hint = (f"check {envvars.URL}, and that the server runs with --listen" if self.remote
                    else "start one with `gpuswap server`, or set GPUSWAP_HOME")
            raise ClientError(f"no gpuswap daemon is listening on {self.sock} ({hint})", EX_UNAVAILABLE) from None
        except httpx.TimeoutException:
            raise ClientError(f"the gpuswap daemon on {self.sock} did not answer in time", EX_UNAVAILABLE) from None
        except httpx.TransportError as e:
            raise ClientError(f"lost the connection to the gpuswap daemon: {e}", EX_UNAVAILABLE) from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            code = EX_USAGE if r.status_code in (400, 422) else EX_FAILURE
            raise ClientError(str(detail), code)
        return r

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw).json()

    def post(self, path: str, body: Optional[dict[str, Any]] = None) -> Any:
        return self.request("POST", path, json=body or {}).json()
