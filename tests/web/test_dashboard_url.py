"""`gpuswap dashboard-url` on a daemon without a TCP listener fails (exit 1, one clear line) and
leaves no token behind (issue 10 item 12): the daemon refuses before it makes one."""
from __future__ import annotations

import json


def test_dashboard_url_without_listener_leaves_no_token(daemon):
    r = daemon.cli("dashboard-url")
    assert r.returncode == 1, r
    assert "no TCP listener" in r.stderr and "--listen" in r.stderr and "Traceback" not in r.stderr, r.stderr
    ls = daemon.cli("token", "ls", "--json")
    assert ls.returncode == 0 and json.loads(ls.stdout) == [], ls
    # A plain token (for later use over TCP) can still be made without a listener.
    assert daemon.cli("token", "create", "--json").returncode == 0
    assert len(json.loads(daemon.cli("token", "ls", "--json").stdout)) == 1
