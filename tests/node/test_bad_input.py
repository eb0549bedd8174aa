"""Malformed or hostile requests get a 4xx with a clear message; the daemon never dies of them."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from gpuswap_testing import Daemon

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


@pytest.fixture(scope="module")
def shared() -> Iterator[Daemon]:
    """One daemon for every request (a start and a stop took ~0.9 s of each case's 0.9 s), with a
    GPU per case (and one for the job-id test), so each case's own job starts as it did on a
    daemon of its own."""
    home = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    d = Daemon(home, ["--simulate-gpus", f"{len(BAD) + 1}x80GiB", "--min-runtime", "1",
                      "--max-switch-fraction", "1", "--no-calibrate"])
    try:
        yield d.start()
    finally:
        d.stop()
        subprocess.run(["pkill", "-9", "-f", str(home)], check=False)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def daemon(shared: Daemon) -> Any:
    # No case depends on another: one that killed the daemon fails itself, and the next case
    # gets a daemon started again.
    if shared.proc is None or shared.proc.poll() is not None:
        shared.start()
    return shared


@pytest.mark.parametrize("method,path,body", BAD)
def test_bad_requests_are_4xx_and_daemon_lives(daemon, method, path, body):
    job = daemon.submit(["sleep", "5"])
    path = path.replace("/v1/jobs/1/", f"/v1/jobs/{job}/")     # this case's own job
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                      base_url="http://x") as c:
        r = c.request(method, path, content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text)
        assert isinstance(r.json()["detail"], str) and r.json()["detail"]
        assert c.get("/v1/health").json()["ok"]


def test_a_job_id_not_in_digits_is_refused_not_read_as_another_job(daemon):
    """A path's job id is ASCII digits, as `gpuswap show` takes it: `int` alone read '1.0', '+1' and
    ' 1' as job 1 (`views.JobId`), here checked on every route that takes one."""
    job = daemon.submit(["sleep", "600"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                      base_url="http://x") as c:
        assert c.get(f"/v1/jobs/{job}").status_code == 200
        for bad in (f"{job}.0", f"+{job}", f"%20{job}", f"{job}e0", f"{job}%C2%B2"):
            for method, tail in (("GET", ""), ("GET", "/log"), ("GET", "/log/tail"), ("GET", "/wait?timeout=0"),
                                 ("POST", "/cancel"), ("POST", "/resume")):
                r = c.request(method, f"/v1/jobs/{bad}{tail}")
                assert r.status_code == 422, (bad, tail, r.status_code, r.text)
                assert "a job id is a whole number >= 1" in r.json()["detail"], r.text
        r = c.post(f"/v1/jobs/{job}.0/pause", json={"to": "ram"})
        assert r.status_code == 422 and "a job id is a whole number" in r.json()["detail"], r.text
        assert c.get(f"/v1/jobs/{job}").json()["state"] in ("PENDING", "RUNNING")   # untouched
        assert c.post(f"/v1/jobs/{job}/cancel").status_code == 200


def test_a_body_sent_as_another_type_than_json_is_a_415_that_says_so(daemon):
    """curl's `-d` sends `application/x-www-form-urlencoded`, others text/plain or no type: FastAPI
    parses only a JSON type as JSON, and the answer was a 422 "Input should be a valid dictionary"
    about a body that was valid JSON. Sent as JSON, the same body is taken."""
    body = b'{"argv": ["true"], "cwd": "/tmp"}'
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                      base_url="http://x") as c:
        for kind in ("text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
            r = c.post("/v1/jobs", content=body, headers={"content-type": kind})
            assert r.status_code == 415, (kind, r.status_code, r.text)
            assert r.json()["detail"] == ("invalid request: the body must be sent as JSON (Content-Type: "
                                          f"application/json), not {kind!r}"), r.text
        r = c.post("/v1/jobs", content=body)
        assert r.status_code == 415 and r.json()["detail"].endswith("and it has no Content-Type"), r.text
        for kind in ("application/json", "application/json; charset=utf-8", "application/merge-patch+json"):
            r = c.post("/v1/jobs", content=body, headers={"content-type": kind})
            assert r.status_code == 201, (kind, r.status_code, r.text)
            assert c.post(f"/v1/jobs/{r.json()['id']}/cancel").status_code in (200, 409)
        r = c.post("/v1/jobs", content=b'{"argv": "true", "cwd": "/tmp"}', headers={"content-type": "text/plain"})
        assert r.status_code == 415, r.text        # the type is told first, not the field
        r = c.post("/v1/jobs", content=b'{"argv": "true", "cwd": "/tmp"}', headers={"content-type": "application/json"})
        assert r.status_code == 422 and "argv" in r.json()["detail"], r.text


def test_a_body_that_is_not_json_is_a_400_that_says_so(daemon):
    """As the schema and docs/dashboard.md say (400 for a body that is not JSON text); it was a 422
    "invalid request: 1: JSON decode error"."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(daemon.home / "gpuswap.sock")),
                      base_url="http://x") as c:
        r = c.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith("invalid request: the body is not JSON: "), r.text
