"""Long polls hold no worker thread: `wait` handlers once slept on anyio's 40 threads, so 40 users'
`gpuswap wait`s made every other request (`gpuswap ls`, health) queue until the waits timed out."""
from __future__ import annotations

import http.client
import json
import select
import socket

from gpuswap_testing import forever

WAITS = 80      # twice anyio's 40 worker threads


def test_the_api_answers_beside_many_long_waits(daemon):
    """A real daemon, 80 raw waits on a job that runs until cancelled, then `ls` and health. The
    only clock is the daemon's own: a wait answers after 30 s at most, and the requests beside them
    need far less. Before the fix, health answered only once 40 waits had given up."""
    job = daemon.submit(forever(daemon.home), name="waited-on")
    daemon.state(job, "RUNNING")
    waits = []
    for _ in range(WAITS):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(daemon.home / "gpuswap.sock"))
        s.sendall(f"GET /v1/jobs/{job}/wait?timeout=30 HTTP/1.1\r\nHost: gpuswap\r\n\r\n".encode())
        waits.append(s)
    ls = daemon.cli("ls", "--json")
    assert ls.returncode == 0 and [j["id"] for j in json.loads(ls.stdout)] == [job], ls
    assert daemon.client.get("/v1/health")["ok"]
    poller = select.poll()
    for s in waits:
        poller.register(s, select.POLLIN)
    assert poller.poll(0) == [], "a wait answered before the requests beside it: they queued behind the waits"
    # The waits were live all along: each answers with the job's record (at its end, or at 30 s).
    assert daemon.cli("cancel", str(job)).returncode == 0
    for s in waits:
        r = http.client.HTTPResponse(s)
        r.begin()
        assert r.status == 200 and json.loads(r.read())["id"] == job
        s.close()
    daemon.state(job, "CANCELLED")
