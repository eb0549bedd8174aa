"""A pool node's API socket: `gpuswap` on any server of the pool, as on one machine (docs/ray.md).

The node's agent serves `gpuswap.sock` in its state directory. It decides nothing and keeps no
state of the lab's: it reads each connection's caller from the kernel (SO_PEERCRED), reads one
request at a time from it within the API's own size limits, and queues it; the head takes queued
requests through Ray calls (`take`, then `ack` for what it will serve), replays each into its API
with that caller's identity, and hands the answer back (`answer`). So trust stays in one process (the head: its database, its
authorization), no socket of gpuswap's own runs between machines, and the identity is the
kernel's, never a header (protocol/forwarded.py).

Every client is untrusted and the head may be away: a request the head does not take within
TAKE_TIMEOUT_S is answered 503 (the CLI: "daemon unavailable", exit 69), one taken but not
answered within ANSWER_TIMEOUT_S 504; connections past MAX_CONNECTIONS, requests past MAX_QUEUED,
bodies past the API's limit and chunked bodies are refused at once; an idle connection is closed;
a user has at most MAX_PER_USER connections, so nobody can take every slot from the others.
"""
from __future__ import annotations

import http.server
import itertools
import json
import logging
import os
import secrets
import socketserver
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuswap import peercred
from gpuswap.protocol.forwarded import (HOP_HEADERS, MAX_BODY_BYTES, MAX_HEADERS, MAX_TARGET_CHARS,
                                        ForwardedRequest, ForwardedResponse)

log = logging.getLogger("gpuswap.gateway")

TAKE_TIMEOUT_S = 10.0        # the head takes queued requests at once when it runs; 10 s: it does not
ANSWER_TIMEOUT_S = 50.0      # the API's longest answer is a 30 s `wait`; below the CLI's 60 s timeout
LEASE_S = 3.0                # a take's requests not acknowledged by then go back to the queue
IDLE_TIMEOUT_S = 10.0        # each read of a request (the CLI sends its next one at once)
MAX_CONNECTIONS = 64
MAX_PER_USER = 16            # one user's connections: nobody can take every slot from the others
MAX_HEADER_BYTES = 64 * 1024
MAX_QUEUED = 256
MAX_TAKE = 64


@dataclass(eq=False)       # one request is one entry: compared by identity
class _Pending:
    request: ForwardedRequest
    lease: Optional[int] = None        # the take that holds it, until acknowledged or expired
    taken: float = 0.0
    acked: bool = False
    response: Optional[ForwardedResponse] = None


class Gateway:
    """The queue between a node's socket and the head, and the socket's server.

    A request is served once: a take leases what it returns, and the head serves only what its
    `ack` confirms. A take whose caller died meanwhile (the head killed while its long poll ran:
    Ray lets the call finish) never acknowledges, so its requests go back to the queue after
    LEASE_S for the next head, and the client hears "not answering" only if none takes them."""

    def __init__(self, path: Path, take_timeout_s: float = TAKE_TIMEOUT_S, answer_timeout_s: float = ANSWER_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, lease_s: float = LEASE_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.path = path
        self.take_timeout_s, self.answer_timeout_s, self.lease_s = take_timeout_s, answer_timeout_s, lease_s
        # Numbered from a random start: an agent restarted by Ray counts afresh, and an answer or an
        # acknowledgement the head meant for the one before must never match a new client's request.
        self._ids = itertools.count(secrets.randbits(62))
        self._takes = itertools.count(secrets.randbits(62))
        self._lock = threading.Condition()
        self._queue: list[_Pending] = []              # neither leased nor acknowledged, oldest first
        self._open: dict[int, _Pending] = {}          # every request not yet answered
        self.max_connections, self.idle_timeout_s = max_connections, idle_timeout_s
        self._conn_lock = threading.Lock()
        self._by_user: dict[int, int] = {}          # uid -> its connections open now
        self._server: Optional[_Server] = None

    # -- the head's side (called through Ray) ------------------------------------------------------

    def take(self, wait_s: float) -> tuple[int, list[ForwardedRequest]]:
        """(this take's number, the requests queued now, or the first within `wait_s`): a long
        poll, so one Ray call a request at most and none while nobody asks. Leased: serve only
        what `ack(take, ids)` then confirms."""
        deadline = time.monotonic() + max(0.0, min(wait_s, 30.0))
        with self._lock:
            while True:
                now = time.monotonic()
                self._requeue_expired(now)
                if self._queue:
                    break
                if now >= deadline:
                    return 0, []
                self._lock.wait(min(deadline - now, self.lease_s))
            token = next(self._takes)
            taken, self._queue = self._queue[:MAX_TAKE], self._queue[MAX_TAKE:]
            for p in taken:
                p.lease, p.taken = token, now
        return token, [p.request for p in taken]

    def ack(self, token: int, request_ids: list[int]) -> list[int]:
        """The requests of take `token` that are still its to serve (not expired, client still there)."""
        with self._lock:
            mine = [i for i in request_ids if (p := self._open.get(i)) is not None and p.lease == token and not p.acked]
            for i in mine:
                self._open[i].acked = True
            self._lock.notify_all()
        return mine

    def answer(self, request_id: int, response: ForwardedResponse) -> bool:
        """The head's answer to an acknowledged request; False if its client is gone (timed out)."""
        with self._lock:
            p = self._open.get(request_id)
            if p is None or not p.acked:
                return False
            p.response = response
            self._lock.notify_all()
        return True

    def _requeue_expired(self, now: float) -> None:
        for p in self._open.values():
            if p.lease is not None and not p.acked and now - p.taken > self.lease_s:
                p.lease = None
                self._queue.append(p)

    # -- the socket's side -------------------------------------------------------------------------

    def submit(self, request: ForwardedRequest) -> ForwardedResponse:
        """Queue a request and wait for the head's answer (or a timeout's)."""
        with self._lock:
            if len(self._open) >= MAX_QUEUED:
                return _error(503, f"this node's gpuswap agent has {MAX_QUEUED} requests waiting for the pool's "
                                   "head; try again")
            p = _Pending(request)
            self._open[request.id] = p
            self._queue.append(p)
            self._lock.notify_all()
            start = time.monotonic()
            try:
                while p.response is None:
                    now = time.monotonic()
                    if not p.acked and now - start >= self.take_timeout_s:
                        if p in self._queue:
                            self._queue.remove(p)
                        return _error(503, "the pool's head (`gpuswap server --ray`) is not answering this node: "
                                           "running jobs go on, nothing new starts until it is back")
                    if now - start >= self.answer_timeout_s:
                        return _error(504, "the pool's head took this request but did not answer in time")
                    self._lock.wait((self.answer_timeout_s if p.acked else self.take_timeout_s) - (now - start))
                return p.response
            finally:
                self._open.pop(request.id, None)

    def open_connection(self, uid: int) -> Optional[str]:
        """Count a new connection of `uid`; why not, if it is one too many (for it, or for all)."""
        with self._conn_lock:
            if sum(self._by_user.values()) >= self.max_connections:
                return f"this gpuswap agent has {self.max_connections} connections open; try again"
            if self._by_user.get(uid, 0) >= min(MAX_PER_USER, self.max_connections):
                return f"you have {MAX_PER_USER} connections open to this gpuswap agent; try again"
            self._by_user[uid] = self._by_user.get(uid, 0) + 1
        return None

    def close_connection(self, uid: int) -> None:
        with self._conn_lock:
            left = self._by_user.get(uid, 0) - 1
            if left > 0:
                self._by_user[uid] = left
            else:
                self._by_user.pop(uid, None)

    def next_id(self) -> int:
        return next(self._ids)

    def start(self) -> None:
        """Serve `path` (0666: the kernel says who connects; the directory above is 0711)."""
        if self.path.is_socket():
            self.path.unlink()       # stale: our agent holds its node's lock, so nobody else serves it
        server = _Server(str(self.path), _Handler, bind_and_activate=False)
        server.gateway = self
        try:
            server.server_bind()
            os.chmod(self.path, 0o666)
            server.server_activate()
        except OSError:
            server.server_close()
            raise
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name="gateway",
                         daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _error(status: int, detail: str) -> ForwardedResponse:
    return ForwardedResponse(status, (("content-type", "application/json"),),
                             json.dumps({"detail": detail}).encode())


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 64
    gateway: Gateway

    def __init__(self, *args, **kw):     # type: ignore[no-untyped-def]
        super().__init__(*args, **kw)
        self._uids: dict[int, int] = {}    # a connection -> its caller's uid, until its thread has it

    def process_request(self, request, client_address):     # type: ignore[no-untyped-def]
        try:
            uid = peercred.peer(request).uid
        except OSError:
            self.shutdown_request(request)
            return
        refused = self.gateway.open_connection(uid)
        if refused is not None:
            busy = json.dumps({"detail": refused}).encode()
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(busy), busy))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._uids[id(request)] = uid
        try:
            super().process_request(request, client_address)
        except BaseException:            # no thread started (a limit on threads): the slot is given back
            self._uids.pop(id(request), None)
            self.gateway.close_connection(uid)
            raise

    def process_request_thread(self, request, client_address):     # type: ignore[no-untyped-def]
        uid = self._uids.pop(id(request))
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gateway.close_connection(uid)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version, sys_version = "gpuswap-agent", ""
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.gateway.idle_timeout_s)   # each read of a request
        self.peer = peercred.peer(self.connection)

    def log_message(self, format: str, *args: object) -> None:   # noqa: A002 (the base class's name)
        pass          # no access log (the head's API logs none either); refusals are answered

    def address_string(self) -> str:
        return f"pid {self.peer.pid}"

    def _forward(self) -> None:
        if len(self.path) > MAX_TARGET_CHARS or not self.path.startswith("/"):
            return self._reply(_error(414 if len(self.path) > MAX_TARGET_CHARS else 400, "bad request target"))
        if len(self.headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in self.headers.items()) > MAX_HEADER_BYTES:
            self.close_connection = True
            return self._reply(_error(431, "too many headers, or too large"))
        if "transfer-encoding" in self.headers:
            self.close_connection = True         # its body is not read
            return self._reply(_error(411, "send the body with a Content-Length"))
        lengths = self.headers.get_all("content-length") or ["0"]
        if len(lengths) != 1 or not lengths[0].strip().isdigit():
            self.close_connection = True
            return self._reply(_error(400, "bad Content-Length"))
        length = int(lengths[0])
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            return self._reply(_error(413, f"request body over {MAX_BODY_BYTES} bytes"))
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            self.close_connection = True
            return
        gw = self.server.gateway
        headers = tuple((k.lower(), v) for k, v in self.headers.items() if k.lower() not in HOP_HEADERS)
        req = ForwardedRequest(gw.next_id(), self.peer.uid, self.peer.gid, self.peer.pid, self.command,
                               self.path, headers, body)
        self._reply(gw.submit(req))

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    def _reply(self, r: ForwardedResponse) -> None:
        try:
            self.send_response(r.status)
            for k, v in r.headers:
                if k.lower() not in HOP_HEADERS:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(r.body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(r.body)
        except OSError:
            self.close_connection = True
