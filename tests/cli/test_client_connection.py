"""The CLI's client keeps one connection to the daemon's socket and handles the daemon closing it.

A daemon closes an idle kept connection on its own clock (uvicorn's keep-alive timeout, the
connection guard under fd pressure); the moment cannot be set from outside, so the peer here is
a scripted Unix socket server that closes the kept connection on the next request, as a daemon
does when its timeout fires just as the request arrives."""
from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from gpuswap.api.client import Client, ClientError



def ok(n: int, close: bool = False) -> bytes:
    body = b'{"n": %d}' % n
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + (b"Connection: close\r\n" if close else b"")
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head


def serve(sock: socket.socket, log: list[bytes]) -> None:
    """Connection 1 answers its first request, then closes when the second arrives; every later
    connection answers one request and closes."""
    conn, _ = sock.accept()
    log.append(read_request(conn).split(b"\r\n")[0])
    conn.sendall(ok(1))
    log.append(read_request(conn).split(b"\r\n")[0] + b" (closed unanswered)")
    conn.close()
    n = 2
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        head = read_request(conn)
        log.append(head.split(b"\r\n")[0])
        conn.sendall(ok(n, close=True))
        conn.close()
        n += 1


@pytest.fixture
def peer(tmp_path: Path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "gpuswap.sock"))
    sock.listen(8)
    log: list[bytes] = []
    t = threading.Thread(target=serve, args=(sock, log), daemon=True)
    t.start()
    yield tmp_path, log
    sock.close()


def test_a_get_on_a_connection_closed_under_it_goes_again_on_a_new_one(peer):
    home, log = peer
    c = Client(home, timeout=30)
    assert c.get("/v1/a") == {"n": 1}
    assert c.get("/v1/b") == {"n": 2}          # sent on the kept connection, which closed: again
    assert log == [b"GET /v1/a HTTP/1.1", b"GET /v1/b HTTP/1.1 (closed unanswered)", b"GET /v1/b HTTP/1.1"]


def test_a_post_on_a_connection_closed_under_it_is_never_sent_twice(peer):
    home, log = peer
    c = Client(home, timeout=30)
    assert c.get("/v1/a") == {"n": 1}
    with pytest.raises(ClientError) as e:
        c.post("/v1/jobs", {"argv": ["true"]})
    assert e.value.exit_code == 69 and "lost the connection" in str(e.value)
    assert c.get("/v1/c") == {"n": 2}          # the next request opens a new connection
    assert log == [b"GET /v1/a HTTP/1.1", b"POST /v1/jobs HTTP/1.1 (closed unanswered)", b"GET /v1/c HTTP/1.1"]


def test_an_answer_sent_before_the_body_was_read_is_the_answer(tmp_path: Path):
    """A daemon refuses a body too large from its headers alone (413) and closes while the client
    still sends it: the client reads that answer (once a broken pipe, exit 69) and exits 64."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "gpuswap.sock"))
    sock.listen(1)

    def refuse() -> None:
        conn, _ = sock.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        body = b'{"detail": "request body too large: the limit is 1 MiB"}'
        conn.sendall(b"HTTP/1.1 413 Content Too Large\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        conn.close()

    threading.Thread(target=refuse, daemon=True).start()
    with pytest.raises(ClientError) as e:       # under the CLI's own limit, far over a socket's buffer
        Client(tmp_path, timeout=30).post("/v1/jobs", {"argv": ["x" * 900_000]})
    sock.close()
    assert e.value.exit_code == 64 and str(e.value) == "request body too large: the limit is 1 MiB"


def test_no_daemon_is_exit_69_in_one_line(tmp_path: Path):
    with pytest.raises(ClientError) as e:
        Client(tmp_path).get("/v1/health")
    assert e.value.exit_code == 69 and "no gpuswap daemon is listening" in str(e.value)
