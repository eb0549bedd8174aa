"""Peer credentials decide who calls; users see and act on their own jobs only; jobs run as them.

The second user is `nobody`. Its requests come from a forked child that drops to its uid before
connecting, so the daemon sees a genuinely different SO_PEERCRED (the interpreter itself lives
under /root, which `nobody` could not exec)."""
from __future__ import annotations

import json
import os
import pwd
from typing import Any, Optional

import pytest

import gpuswap_testing
from gpuswap_testing import Gate

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


class AsUser:
    """One user's raw API requests on `home`'s socket (the shared fork helper does the switch)."""

    def __init__(self, home, uid: int, gid: int):
        self.home, self.user = home, gpuswap_testing.AsUser(uid, gid)

    def request(self, method: str, path: str, body: Optional[dict] = None) -> tuple[int, Any]:
        return self.user.api(self.home, method, path, body)


@pytest.fixture
def nobody(daemon):
    pw = pwd.getpwnam("nobody")
    return AsUser(daemon.home, pw.pw_uid, pw.pw_gid)


def test_job_runs_as_submitting_user(daemon, nobody):
    code, rec = nobody.request("POST", "/v1/jobs", {"argv": ["sh", "-c", "id -u; id -g"], "cwd": "/tmp",
                                                    "env": {"PATH": os.environ["PATH"]}})
    assert code == 201, rec
    j = daemon.state(rec["id"], "COMPLETED")
    assert j["user"] == "nobody"
    out = daemon.cli("logs", str(rec["id"])).stdout.split()
    assert out == [str(nobody.user.uid), str(nobody.user.gid)]


def test_users_see_and_act_on_their_own_jobs_only(daemon, nobody):
    never = Gate(daemon.home / "never")          # both jobs run until cancelled, however slow the calls
    mine = daemon.submit(never.sh(), name="roots-job")          # submitted as root
    daemon.state(mine, "RUNNING")
    code, listed = nobody.request("GET", "/v1/jobs")
    assert code == 200 and mine not in [j["id"] for j in listed]
    for method, path, body in (("GET", f"/v1/jobs/{mine}", None), ("POST", f"/v1/jobs/{mine}/cancel", None),
                               ("POST", f"/v1/jobs/{mine}/pause", {"to": "ram"}),
                               ("GET", f"/v1/jobs/{mine}/log", None)):
        code, rec = nobody.request(method, path, body)
        assert code == 404 and rec["detail"] == f"no job {mine}", (path, code, rec)
    assert nobody.request("GET", "/v1/jobs?all=true")[0] == 403
    assert daemon.job(mine)["state"] == "RUNNING"
    code, gpus = nobody.request("GET", "/v1/gpus")
    assert gpus["gpus"][0]["jobs"][0]["user"] == "(other)"
    # nobody's own job: visible and cancellable by nobody; root (admin) sees and acts on both
    code, theirs = nobody.request("POST", "/v1/jobs", {"argv": never.sh(), "cwd": "/tmp",
                                                       "env": {"PATH": os.environ["PATH"]}})
    assert [j["id"] for j in nobody.request("GET", "/v1/jobs")[1]] == [theirs["id"]]
    all_jobs = json.loads(daemon.cli("ls", "--all-users", "--json").stdout)
    assert {mine, theirs["id"]} <= {j["id"] for j in all_jobs}
    assert nobody.request("POST", f"/v1/jobs/{theirs['id']}/cancel")[0] == 200
    assert daemon.cli("cancel", str(mine)).returncode == 0
