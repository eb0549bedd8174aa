"""A pool node's API socket (node/gateway.py) on its own: the caller is the kernel's, the request
reaches the head as sent, and every way a client or an absent head could stall it is bounded.
The whole path through Ray and the head's API is tests/ray/test_ray_pool.py's."""
from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from gpuswap.api.client import Client, ClientError
from gpuswap.exitcodes import EX_UNAVAILABLE
from gpuswap.node.gateway import Gateway
from gpuswap.protocol.forwarded import MAX_BODY_BYTES, ForwardedRequest, ForwardedResponse
from gpuswap_testing import AsUser, ensure_user


@pytest.fixture
def home() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gs-gw-", dir="/tmp"))    # pytest's own is root's alone
    d.chmod(0o711)                # another user reaches the socket, as in the agent's home
    yield d
    shutil.rmtree(d, ignore_errors=True)


def serve(gw: Gateway, seen: list[ForwardedRequest], stop: threading.Event) -> threading.Thread:
    """A head that takes every request and answers with what it was given."""
    def run() -> None:
        while not stop.is_set():
            token, taken = gw.take(0.2)
            for r in taken:
                assert gw.ack(token, [r.id]) == [r.id]
                seen.append(r)
                body = json.dumps({"uid": r.uid, "gid": r.gid, "method": r.method, "target": r.target,
                                   "headers": dict(r.headers), "body": r.body.decode()}).encode()
                gw.answer(r.id, ForwardedResponse(201, (("content-type", "application/json"), ("x-next-offset", "7")),
                                                  body))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture
def gateway(home: Path) -> Iterator[tuple[Gateway, list[ForwardedRequest]]]:
    gw = Gateway(home / "gpuswap.sock")
    gw.start()
    seen: list[ForwardedRequest] = []
    stop = threading.Event()
    serve(gw, seen, stop)
    yield gw, seen
    stop.set()
    gw.stop()


def raw(path: Path, data: bytes) -> bytes:
    """One request's bytes sent as they are; the answer read to the end of the connection."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_the_caller_is_the_one_the_kernel_reports_and_the_request_arrives_as_sent(gateway, home):
    gw, seen = gateway
    uid, gid = ensure_user("gs-gw-user")
    status, body = AsUser(uid, gid).api(home, "POST", "/v1/jobs?x=1", {"argv": ["true"]})
    assert status == 201
    assert (body["uid"], body["gid"]) == (uid, gid)          # not root's, who runs the gateway
    assert body["method"] == "POST" and body["target"] == "/v1/jobs?x=1"
    assert json.loads(body["body"]) == {"argv": ["true"]}
    # Headers of the hop are the gateway's business, not the head's.
    assert "content-length" not in body["headers"] and "host" not in body["headers"]
    # The head's headers come back to the client (a log read's offset, say).
    r = Client(home).request("GET", "/v1/jobs/1/log")
    assert r.status_code == 201 and r.headers["x-next-offset"] == "7"
    assert [r.uid for r in seen][-2:] == [uid, 0]


def test_a_body_over_the_limit_or_chunked_is_refused_before_it_is_queued(gateway, home):
    gw, seen = gateway
    big = raw(gw.path, b"POST /v1/jobs HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
    assert big.startswith(b"HTTP/1.1 413 ")
    chunked = raw(gw.path, b"POST /v1/jobs HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert chunked.startswith(b"HTTP/1.1 411 ")
    bad = raw(gw.path, b"POST /v1/jobs HTTP/1.1\r\nContent-Length: -3\r\n\r\n")
    assert bad.startswith(b"HTTP/1.1 413 ") or bad.startswith(b"HTTP/1.1 400 ")
    short = raw(gw.path, b"POST /v1/jobs HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")    # then the client leaves
    assert short == b""
    assert seen == []


def test_without_a_head_the_client_gets_a_clear_answer_and_exit_69(home):
    gw = Gateway(home / "gpuswap.sock", take_timeout_s=0.5)
    gw.start()
    try:
        with pytest.raises(ClientError) as e:
            Client(home).get("/v1/jobs")
        assert e.value.exit_code == EX_UNAVAILABLE
        assert "head" in str(e.value) and "not answering" in str(e.value)
        assert gw.take(0) == (0, [])        # the request left the queue with its answer
    finally:
        gw.stop()


def test_a_request_acknowledged_but_never_answered_times_out_and_a_late_answer_is_dropped(home):
    gw = Gateway(home / "gpuswap.sock", take_timeout_s=5, answer_timeout_s=5.5)
    gw.start()
    taken: list[ForwardedRequest] = []

    def head() -> None:
        token, got = gw.take(30)
        assert gw.ack(token, [r.id for r in got]) == [r.id for r in got]
        taken.extend(got)

    t = threading.Thread(target=head, daemon=True)
    t.start()
    try:
        with pytest.raises(ClientError) as e:
            Client(home).get("/v1/jobs")
        assert e.value.exit_code == EX_UNAVAILABLE and "did not answer in time" in str(e.value)
        t.join()
        assert len(taken) == 1
        assert gw.answer(taken[0].id, ForwardedResponse(200)) is False     # its client is gone
    finally:
        gw.stop()


def test_a_take_never_acknowledged_goes_back_to_the_queue_and_is_served_once(home):
    """The head killed during its long poll: Ray finishes the call, whose requests nobody will
    serve. They are leased, not lost: the next head's take gets them once the lease expires, and
    the dead take's late acknowledgement confirms nothing (no request is served twice)."""
    gw = Gateway(home / "gpuswap.sock", lease_s=0.2)
    gw.start()
    dead: list[tuple[int, list[ForwardedRequest]]] = []
    t = threading.Thread(target=lambda: dead.append(gw.take(30)), daemon=True)
    t.start()
    answers: list[bytes] = []
    client = threading.Thread(target=lambda: answers.append(Client(home).request("GET", "/v1/jobs").content),
                              daemon=True)
    client.start()
    try:
        t.join()
        [(dead_token, dead_requests)] = dead
        assert len(dead_requests) == 1
        token, again = gw.take(30)                     # the next head, after the lease
        assert [r.id for r in again] == [r.id for r in dead_requests] and token != dead_token
        assert gw.ack(dead_token, [r.id for r in dead_requests]) == []     # too late: not its any more
        assert gw.ack(token, [r.id for r in again]) == [r.id for r in again]
        assert gw.answer(again[0].id, ForwardedResponse(200, (), b'"served"'))
        client.join()
        assert answers == [b'"served"']
    finally:
        gw.stop()


def test_connections_past_the_cap_are_refused_and_the_others_served(home):
    gw = Gateway(home / "gpuswap.sock", max_connections=2, idle_timeout_s=600)
    gw.start()
    seen: list[ForwardedRequest] = []
    stop = threading.Event()
    serve(gw, seen, stop)
    idle = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    try:
        for s in idle:
            s.connect(str(gw.path))
        # Both slots are held by idle connections: the next is answered 503 at once and closed
        # (read before sending anything: a request the server never reads would reset it).
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(gw.path))
            refused = b""
            while chunk := s.recv(65536):
                refused += chunk
        assert refused.startswith(b"HTTP/1.1 503 ") and b"2 connections open" in refused
        assert seen == []
        for s in idle:
            s.close()
        # A slot frees once the server has seen its connection end.
        # Until then a request is refused (a reset: the refusal does not read it).
        def attempt() -> bytes:
            try:
                return raw(gw.path, b"GET /v1/jobs HTTP/1.1\r\n\r\n")
            except (ConnectionResetError, BrokenPipeError):
                return b""

        deadline = time.monotonic() + 120
        got = attempt()
        while not got.startswith(b"HTTP/1.1 201 ") and time.monotonic() < deadline:
            time.sleep(0.05)
            got = attempt()
        assert got.startswith(b"HTTP/1.1 201 "), got[:200]
        assert len(seen) == 1
    finally:
        stop.set()
        for s in idle:
            s.close()
        gw.stop()


def test_the_cli_finds_a_pool_nodes_socket_where_the_machine_has_no_daemon(monkeypatch):
    """With no GPUSWAP_HOME: the machine-wide daemon's socket if it serves, else the node agent's
    (its default home, SYSTEM_HOME/node), else the usual default."""
    from gpuswap.api import client

    d = Path(tempfile.mkdtemp(prefix="gs-gw-", dir="/tmp"))
    try:
        monkeypatch.setattr(client, "SYSTEM_HOME", d)
        monkeypatch.delenv("GPUSWAP_HOME", raising=False)
        monkeypatch.setattr(client.os, "geteuid", lambda: 1000)      # an ordinary user
        monkeypatch.setenv("HOME", str(d / "user"))
        assert client.client_home() == d / "user" / ".gpuswap"       # nothing serves here
        node = Gateway(d / "node" / "gpuswap.sock")
        (d / "node").mkdir()
        node.start()
        try:
            assert client.client_home() == d / "node"                 # a pool node: its agent
            (d / "gpuswap.sock").touch()
            assert client.client_home() == d                           # a daemon of the machine's own
            monkeypatch.setenv("GPUSWAP_HOME", str(d / "mine"))
            assert client.client_home() == d / "mine"                  # said explicitly
        finally:
            node.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_one_users_connections_cannot_take_every_slot_from_the_others(home):
    """At most MAX_PER_USER connections per user: a user holding theirs open (idle, or slow to send)
    is refused more, and another user is still served."""
    from gpuswap.node.gateway import MAX_PER_USER

    gw = Gateway(home / "gpuswap.sock", max_connections=MAX_PER_USER + 4, idle_timeout_s=600)
    gw.start()
    seen: list[ForwardedRequest] = []
    stop = threading.Event()
    serve(gw, seen, stop)
    held = [socket.socket(socket.AF_UNIX) for _ in range(MAX_PER_USER)]
    try:
        for s in held:
            s.connect(str(gw.path))
            s.sendall(b"GET /v1/jobs HTTP/1.1\r\n")           # a request begun, never finished
        with socket.socket(socket.AF_UNIX) as s:                # root's next connection: refused
            s.settimeout(30)
            s.connect(str(gw.path))
            refused = b""
            while chunk := s.recv(65536):
                refused += chunk
        assert refused.startswith(b"HTTP/1.1 503 ") and f"you have {MAX_PER_USER} connections".encode() in refused
        uid, gid = ensure_user("gs-gw-user")
        status, body = AsUser(uid, gid).api(home, "GET", "/v1/jobs")   # another user: served
        assert status == 201 and body["uid"] == uid
    finally:
        stop.set()
        for s in held:
            s.close()
        gw.stop()


def test_ids_start_at_random_so_a_restarted_agent_never_matches_an_old_answer(home):
    """An answer or acknowledgement meant for the agent before a restart must not match a new
    client's request: each gateway numbers its requests and takes from its own random start."""
    first, second = Gateway(home / "a.sock"), Gateway(home / "b.sock")
    assert abs(first.next_id() - second.next_id()) > 1_000_000
    assert second.answer(first.next_id(), ForwardedResponse(200)) is False
