"""Remote access: `--listen` with bearer tokens, the same authorization rules as the Unix socket."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time

import pytest
from webtools import Web, free_port, web  # noqa: F401  (fixture)

from gpuswap_testing import Gate, forever

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a token for a second user")


def _remote_cli(web: Web, token: str | None, *args: str, url: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    env["GPUSWAP_URL"] = url or web.url
    if token is not None:
        env["GPUSWAP_TOKEN"] = token
    # A home with no daemon: proves the CLI really went over TCP.
    env["GPUSWAP_HOME"] = "/nonexistent-gpuswap-home"
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_tcp_requires_a_valid_token(web):
    with web.http(None) as anon:
        r = anon.get("/v1/jobs")
        assert r.status_code == 401 and "Bearer" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
    with web.http("gst_000000000000_" + "A" * 43) as forged, web.http("nonsense") as junk:
        assert forged.get("/v1/jobs").status_code == 401
        assert junk.get("/v1/overview").status_code == 401
    token = web.token()
    with web.http(token) as c:
        assert c.get("/v1/jobs").status_code == 200
        assert c.get("/v1/overview").json()["caller"] == {"user": "root", "uid": 0, "admin": True}


def test_tokens_are_stored_hashed_and_revocable(web):
    token = web.token()
    tid = token.split("_")[1]
    secret = token.split("_", 2)[2]
    db = sqlite3.connect(web.daemon.home / "state.db")
    rows = db.execute("SELECT * FROM tokens").fetchall()
    db.close()
    assert rows and all(secret not in str(r) for r in rows)
    listed = web.daemon.client.get("/v1/tokens")
    assert [t["id"] for t in listed] == [tid] and "hash" not in listed[0]
    with web.http(token) as c:
        assert c.get("/v1/jobs").status_code == 200
        assert c.post("/v1/tokens", json={}).status_code == 403   # tokens are minted on the Unix socket only
        assert c.delete(f"/v1/tokens/{tid}").status_code == 200
        assert c.get("/v1/jobs").status_code == 401


def test_other_users_token_same_rules_as_socket(web):
    root_job = web.daemon.submit(Gate(web.daemon.home / "never").sh(), name="roots",   # runs until cancelled
                                 time_limit_s=7200)
    nobody = web.token("nobody")
    with web.http(nobody) as c:
        me = c.get("/v1/overview").json()
        assert me["caller"]["user"] == "nobody" and not me["caller"]["admin"]
        others = [j for j in me["jobs"] if j["id"] == root_job]
        assert others and others[0]["name"] == "" and not others[0]["mine"]   # visible, but not theirs
        # Its estimate comes from its owner's history: not shown to others (as its name and step).
        assert (others[0]["estimate_s"], others[0]["estimate_left_s"]) == (None, None)
        assert "estimate" not in others[0] and "estimate_from" not in others[0]
        assert c.get(f"/v1/jobs/{root_job}").status_code == 404
        assert c.post(f"/v1/jobs/{root_job}/cancel").status_code == 404
        assert c.post(f"/v1/jobs/{root_job}/pause", json={"to": "ram"}).status_code == 404
        assert c.get(f"/v1/jobs/{root_job}/log/tail").status_code == 404
        assert c.get("/v1/jobs", params={"all": "true"}).status_code == 403
        r = c.post("/v1/jobs", json={"argv": ["sh", "-c", "id -un"], "cwd": "/tmp", "env": {"PATH": "/usr/bin:/bin"}})
        assert r.status_code == 201, r.text
        mine = r.json()["id"]
    j = web.daemon.state(mine, "COMPLETED")
    assert j["user"] == "nobody"
    assert web.daemon.cli("logs", str(mine)).stdout.strip() == "nobody"
    assert web.daemon.job(root_job)["state"] == "RUNNING"
    web.daemon.cli("cancel", str(root_job))


def test_cli_over_tcp_and_its_errors(web):
    job = web.daemon.submit(forever(web.daemon.home), name="remote-visible")
    ok = _remote_cli(web, web.token(), "ls", "--json")
    assert ok.returncode == 0, ok.stderr
    assert "remote-visible" in ok.stdout
    bad = _remote_cli(web, "gst_000000000000_" + "A" * 43, "ls")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "unauthenticated" in bad.stderr
    missing = _remote_cli(web, None, "ls")
    assert missing.returncode == 64 and "GPUSWAP_TOKEN" in missing.stderr
    down = _remote_cli(web, "x", "ls", url=f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 69 and down.stderr.count("\n") == 1
    web.daemon.cli("cancel", str(job))


def test_token_cli_prints_usable_url(web):
    out = web.daemon.cli("token", "create", "--note", "laptop")
    assert out.returncode == 0, out.stderr
    assert f"GPUSWAP_URL={web.url}" in out.stdout and "/ui/#token=gst_" in out.stdout
    url = web.daemon.cli("dashboard-url").stdout.strip()
    assert url.startswith(f"{web.url}/ui/#token=gst_")
    ls = web.daemon.cli("token", "ls")
    assert "laptop" in ls.stdout and "dashboard" in ls.stdout
    unknown = web.daemon.cli("token", "create", "--user", "no-such-user-here")
    assert unknown.returncode == 64 and "no user" in unknown.stderr


@pytest.mark.parametrize("spec, message, code", [("127.0.0.1:notaport", "cannot read --listen", 64),
                                                 ("999.1.1.1:80", "cannot listen on", 1)])
def test_bad_listen_address_is_one_line(make_daemon, home, spec, message, code):
    """Unreadable: a usage error (64). Readable but not bindable: a failure (1)."""
    env = dict(os.environ, GPUSWAP_HOME=str(home))
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1",
                        "--listen", spec], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == code and message in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_requests_that_cannot_be_parsed_are_logged_once_a_minute_not_once_each(web):
    """uvicorn writes a WARNING line for each request it cannot parse, and anyone who reaches
    --listen may send such requests: the log grew a line each, without end. Each is still answered
    400 and the daemon goes on; its log says so once a minute (conn_guard.OncePerMinute)."""
    import socket

    host, port = web.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(40):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert s.recv(200).startswith(b"HTTP/1.1 400 "), "not answered 400"
    with web.http(None) as c:
        assert c.get("/v1/health").json()["ok"]
    log = (web.daemon.home / "daemon.out").read_text()
    said = [ln for ln in log.splitlines() if "Invalid HTTP request" in ln]
    assert len(said) == 1 and "answered 400 (said at most once a minute)" in said[0], log[-3000:]


def test_port_in_use_is_one_line_exit_1(web, tmp_path):
    port = web.url.rsplit(":", 1)[1]
    env = dict(os.environ, GPUSWAP_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1",
                        "--listen", f"127.0.0.1:{port}"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen on" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_dashboard_and_log_tail_headers(web):
    """The page may run only its own files (CSP), cannot be framed, and nothing is MIME-sniffed:
    a job's log tail is text/plain and stays text even if it holds HTML."""
    job = web.daemon.submit(forever(web.daemon.home, "echo '<script>alert(1)</script>'"), name="<b>x</b>")
    web.daemon.state(job, "RUNNING")
    with web.http(None) as anon:
        page = anon.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["x-frame-options"] == "DENY"
    with web.http(web.token()) as c:
        deadline = time.monotonic() + 180
        while "<script>" not in (tail := c.get(f"/v1/jobs/{job}/log/tail")).text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tail.headers["content-type"] == "text/plain; charset=utf-8"
        assert tail.headers["x-content-type-options"] == "nosniff" and "<script>alert(1)</script>" in tail.text
        assert c.get("/v1/overview").headers["x-content-type-options"] == "nosniff"
    web.daemon.cli("cancel", str(job))


def test_a_token_dies_with_its_account_and_is_not_inherited_by_the_next_owner_of_its_uid(web):
    """A token acted on after its account was deleted (as a uid nobody owned), then as the account
    given that uid next: `jobs run as the user who submitted them` broke once an admin reused a uid."""
    from gpuswap_testing import ensure_user

    leaver, heir = f"gs-leaver-{os.getpid()}", f"gs-heir-{os.getpid()}"
    uid, _ = ensure_user(leaver)
    token = web.token(leaver)
    try:
        with web.http(token) as c:
            assert c.get("/v1/jobs").status_code == 200
            subprocess.run(["userdel", leaver], check=True, capture_output=True)
            assert c.get("/v1/jobs").status_code == 401
            subprocess.run(["useradd", "--no-create-home", "-u", str(uid), "--shell", "/usr/sbin/nologin", heir],
                           check=True, capture_output=True)
            assert c.get("/v1/jobs").status_code == 401
            r = c.post("/v1/jobs", json={"argv": ["true"], "cwd": "/tmp", "env": {}})
            assert r.status_code == 401, r.text
    finally:
        for name in (leaver, heir):
            subprocess.run(["userdel", name], capture_output=True)


def test_no_page_on_the_dashboards_origin_loads_outside_scripts_or_names_the_requests_host(web):
    """/docs and /redoc loaded Swagger and ReDoc from a CDN on the origin where the dashboard keeps
    its token; /ui redirected to the request's own Host header (and a forwarded scheme)."""
    with web.http(None) as anon:
        for path in ("/docs", "/redoc"):
            assert anon.get(path).status_code == 404, path
        assert anon.get("/openapi.json").status_code == 200
        r = anon.get("/ui", headers={"Host": "evil.example", "X-Forwarded-Proto": "https"})
        assert r.status_code == 307 and r.headers["location"] == "/ui/", r.headers
    with web.http(web.token()) as c:
        r = c.delete("/v1/tokens/a%0D%0Ab%1B%5B31m")
        assert r.status_code == 404 and r.json()["detail"] == "no token a\\r\\nb\\x1b[31m", r.text
