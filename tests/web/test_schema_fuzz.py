"""Fuzz every operation of the daemon's OpenAPI schema over TCP with schemathesis' conformance
checks: no 5xx, and every answer's status, content type and body are the documented ones; a
method a path does not serve is a 405 whose `Allow` names exactly the documented methods.

Requests carry the token of `nobody` (not an admin), so fuzzed job submissions run harmlessly as
nobody. `/wait` is left out: it is a long poll by design (up to 30 s per call). Examples per
operation and mode: GPUSWAP_FUZZ_EXAMPLES (default 12, about a minute on a loaded 2-core box).
"""
from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from webtools import web  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a token for `nobody`")
EXAMPLES = int(os.environ.get("GPUSWAP_FUZZ_EXAMPLES", "12"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def test_fuzz_api_no_server_errors(web):
    token = web.token("nobody")
    schema = schemathesis.openapi.from_url(f"{web.url}/openapi.json", headers={"Authorization": f"Bearer {token}"})
    headers = {"Authorization": f"Bearer {token}"}
    failures: list[str] = []
    tried: list[str] = []
    statuses: dict[int, int] = {}
    ops = [r.ok() for r in schema.get_all_operations()]
    for op, mode in [(op, mode) for op in ops if not op.path.endswith("/wait") for mode in schemathesis.GenerationMode]:
        tried.append(f"{op.method.upper()} {op.path} ({mode.value})")

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            r = case.call(base_url=web.url, headers=headers, timeout=30)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            try:
                case.validate_response(r, checks=CHECKS, headers=headers)
            except AssertionError as e:   # schemathesis' Failure / FailureGroup
                failures.append(f"{case.method} {case.formatted_path} -> {r.status_code}: {str(e)[:400]}")

        try:
            run()
        except Unsatisfiable:   # nothing to make invalid (an operation without parameters or body)
            assert mode is schemathesis.GenerationMode.NEGATIVE
            tried.pop()
    print(f"fuzzed {len(tried)} operations, {sum(statuses.values())} requests; statuses {sorted(statuses.items())}")
    assert len(tried) >= 15, tried
    assert sum(statuses.values()) >= 5 * len(tried) and 200 in statuses, statuses
    assert not failures, "\n".join(failures)
    with web.http(token) as c:
        assert c.get("/v1/health").json()["ok"]
    assert web.daemon.proc.poll() is None


def test_unserved_methods_are_405_with_the_documented_allow(web):
    """RFC 9110: a 405 names every method the resource serves (Starlette named only the first
    route's when a path has several, e.g. GET and POST /v1/tokens)."""
    token = web.token("nobody")
    paths = httpx.get(f"{web.url}/openapi.json").json()["paths"]
    with web.http(token) as c:
        for path, ops in paths.items():
            url = path.replace("{job_id}", "1").replace("{token_id}", "abc")
            documented = {m.upper() for m in ops}
            documented |= {"HEAD"} if "GET" in documented else set()     # served as GET
            for method in ("OPTIONS", "PUT", "PATCH"):
                if method.lower() in ops:
                    continue
                r = c.request(method, url)
                assert r.status_code == 405, (method, path, r.status_code)
                assert set(r.headers["allow"].replace(" ", "").split(",")) == documented, (method, path, r.headers)
                assert r.json()["detail"]


def test_head_is_answered_as_get_without_the_content(web):
    """RFC 9110 9.3.2: HEAD is GET without the content. Every documented GET (the long poll
    `/wait` aside) answers HEAD with its status and headers and no body, a job's page included,
    with a token and without one; HEAD of a path that serves no GET is a 405 like any other."""
    token = web.token("nobody")
    paths = httpx.get(f"{web.url}/openapi.json").json()["paths"]
    with web.http(token) as c:
        job = c.post("/v1/jobs", json={"argv": ["true"], "cwd": "/tmp"}).json()["id"]
        gets = [p.replace("{job_id}", str(job)) for p, ops in paths.items()
                if "get" in ops and not p.endswith("/wait") and "{token_id}" not in p]
        assert "/v1/health" in gets and f"/v1/jobs/{job}" in gets, gets
        for path in gets:
            got, head = c.get(path), c.head(path)
            assert head.status_code == got.status_code, (path, head.status_code, got.status_code)
            assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"], path
        r = c.head(f"/v1/jobs/{job}/cancel")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b"", r.headers
    anonymous = httpx.head(f"{web.url}/v1/jobs")
    assert anonymous.status_code == 401 and anonymous.content == b""
    assert httpx.head(f"{web.url}/v1/health").status_code == 200
