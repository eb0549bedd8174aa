"""Shared by the web tests and the pool's (tests/ray) browser test; imported, not a conftest:
`from conftest import ...` elsewhere must stay unambiguous.

A real daemon with a TCP listener on 127.0.0.1, helpers to create bearer tokens, and Chromium."""
from __future__ import annotations

import os
import socket
from typing import Any

import httpx
import pytest


# Debian's Chromium (tests/setup-system.sh installs it); Playwright drives it, never its own download.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def why_no_browser(path: str = CHROMIUM) -> str | None:
    """Why the browser tests cannot run (no executable browser at `path`), or None when they can.
    Only looks: installing is tests/setup-system.sh's job, never a test run's."""
    if not os.access(path, os.X_OK):
        return f"{path} is not installed; run tests/setup-system.sh as root (apt-get install chromium)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Web:
    """The daemon (from tests/conftest.py) plus its TCP URL and token helpers."""

    def __init__(self, daemon: Any, url: str):
        self.daemon, self.url = daemon, url

    def token(self, user: str | None = None) -> str:
        return str(self.daemon.client.post("/v1/tokens", {"user": user, "note": "test"})["token"])

    def http(self, token: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def start_web(make_daemon: Any, gpus: str = "2x80GiB", *extra: str) -> Web:
    port = free_port()
    d = make_daemon("--simulate-gpus", gpus, "--min-runtime", "1", "--listen", f"127.0.0.1:{port}", *extra)
    return Web(d, f"http://127.0.0.1:{port}")


@pytest.fixture
def web(make_daemon: Any) -> Web:
    """Two simulated GPUs, so two users' jobs can run side by side."""
    return start_web(make_daemon)
