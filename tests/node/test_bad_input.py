"""Malformed or hostile requests get a 4xx with a clear message; the daemon never dies of them."""
from __future__ import annotations

import httpx
import pytest

BAD = [
    ("POST", "/v1/jobs", b"{not json"),
    ("POST", "/v1/jobs", b"[]"),
    ("POST", "/v1/jobs", b'{"argv": [], "cwd": "/"}'),
    ("POST", "/v1/jobs", b'{"argv": ["true"], "cwd": "/", "priority": "godlike"}'),
    ("POST", "/v1/jobs", b'{"argv": ["true"], "cwd": "/", "gpus": -1}'),
    ("POST", "/v1/jobs", b'{"argv": ["true"], "cwd": "/", "mem": "12 parsecs"}'),
    ("POST", "/v1/jobs", b'{"argv": ["true"], "cwd": "/", "env": {"A": 1}}'),
    ("POST", "/v1/jobs", b'{"argv": ["true"], "cwd": "/", "gpus": 99999999999999999999}'),
    ("GET", "/v1/jobs/notanumber", b""),
    ("GET", "/v1/jobs/99999999999999999999999", b""),
    ("GET", "/v1/jobs/1/log?offset=-5", b""),
    ("POST", "/v1/jobs/1/pause", b'{"to": "moon"}'),
    ("GET", "/v1/nothing-here", b""),
]


@pytest.mark.parametrize("method,path,body", BAD)
def test_bad_requests_are_4xx_and_daemon_lives(daemon, method, path, body):
    daemon.submit(["sleep", "5"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                      base_url="http://x") as c:
        r = c.request(method, path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]
        assert c.get("/v1/health").json()["ok"]
