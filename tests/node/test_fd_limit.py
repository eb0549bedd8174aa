"""Issue 11: a daemon under a low file-descriptor limit keeps answering while clients hold more
idle (or slowly-sending) connections than it has descriptors, and says so in a line or two."""
from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time

import pytest

from gpuswap.api.client import ClientError
from gpuswap_testing import Daemon

NOFILE = 256
IDLE = 400


def _low_fd_limit() -> None:   # in the daemon's child process only
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def start_low_fd_daemon(home) -> Daemon:
    d = Daemon(home, ["--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--max-switch-fraction", "1", "--no-calibrate"])
    d.proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", *d.args], env=d.env,
                              stdout=open(home / "daemon.out", "ab"), stderr=subprocess.STDOUT,
                              preexec_fn=_low_fd_limit)
    deadline = time.monotonic() + 180
    while True:
        assert d.proc.poll() is None, (home / "daemon.out").read_text()
        try:
            d.client.get("/v1/health")
            return d
        except ClientError:
            assert time.monotonic() < deadline, "daemon did not come up"
            time.sleep(0.1)


def health_answers(d: Daemon, within: float) -> float:
    """Seconds until /v1/health answers, polling; fails past `within`. Each try gives up after 5 s
    (a request stuck behind the held connections is tried again); the test's other requests keep
    the Daemon client's 60 s, as a loaded machine needs."""
    from gpuswap.api.client import Client

    probe = Client(d.home, timeout=5)
    t0 = time.monotonic()
    while True:
        try:
            assert probe.get("/v1/health")["ok"]
            return time.monotonic() - t0
        except ClientError:
            assert time.monotonic() - t0 < within, "the daemon stopped answering"
            time.sleep(0.2)


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[0] < IDLE + 200,
                    reason="the test itself needs to hold 400 sockets")
def test_more_idle_connections_than_fds_and_the_daemon_still_answers(home):
    d = start_low_fd_daemon(home)
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while len(held) < IDLE:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(home / "gpuswap.sock"))
            except BlockingIOError:      # its listen backlog is full: retry once it accepted some
                s.close()
                assert time.monotonic() < deadline, f"the daemon stopped accepting after {len(held)}"
                time.sleep(0.01)
                continue
            if len(held) % 10 == 0:      # slowloris: a request's first line, and never the rest
                s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        waited = health_answers(d, within=90)
        job = d.submit(["true"])
        assert d.state(job, "COMPLETED", timeout=120)["exit_code"] == 0
        # the idle ones are closed by the daemon (evicted, or timed out): each sees EOF
        deadline = time.monotonic() + 90
        for s in held:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
        d.stop()
        subprocess.run(["pkill", "-9", "-f", str(home)], check=False)
    out = (home / "daemon.out").read_text()
    noisy = [ln for ln in out.splitlines() if "Too many open files" in ln or "out of system resource" in ln
             or "connections" in ln or "Traceback" in ln]
    assert len(noisy) <= 3, out[-3000:]
    print(f"health answered after {waited:.2f}s with {len(held)} connections held; log lines: {noisy}")
