"""Fuzz every operation of the daemon's OpenAPI schema over TCP: no 5xx, and the daemon stays up.

Requests carry the token of `nobody` (not an admin), so fuzzed job submissions run harmlessly as
nobody. `/wait` is left out: it is a long poll by design (up to 30 s per call).
"""
from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from webtools import web  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a token for `nobody`")
EXAMPLES = int(os.environ.get("GPUSWAP_FUZZ_EXAMPLES", "12"))


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
            if r.status_code >= 500:
                failures.append(f"{case.method} {case.formatted_path} -> {r.status_code}: {r.text[:200]}")

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
