"""A request made on a pool node's socket, replayed into the head's API (docs/ray.md).

The node's agent read the caller from its kernel (node/gateway.py); here the request goes through
the same app, middleware and authorization as one on the head's own socket, with that caller put
where api/auth.py's socket protocol puts a local peer's (the request scope, which no client can
write), and the node it came from beside it (a submit's working directory is checked there).

The app runs on an event loop of its own, in one thread: uvicorn's loop serves the head's sockets
and is not ours to share; most of the app's handlers are synchronous (anyio runs them on threads,
up to HANDLER_THREADS here) and its long polls (30 s `wait`s) are coroutines that hold no thread
while they wait, so one loop carries the forwarded requests side by side.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any
from urllib.parse import unquote

from gpuswap.api.auth import ORIGIN_KEY, SCOPE_KEY
from gpuswap.protocol.forwarded import ForwardedRequest, ForwardedResponse

log = logging.getLogger("gpuswap.forwarded")

ANSWER_TIMEOUT_S = 45.0       # under the node's own 50 s (node/gateway.py): the client gets this answer
# Threads for the app's synchronous handlers on this loop (anyio's default is 40): every node of
# the pool forwards its users' requests through this one loop.
HANDLER_THREADS = 128


class Replayer:
    """`replayer(request, node)`: the app's answer to a forwarded request, as its caller."""

    def __init__(self, app: Any):
        self.app = app
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="forwarded-api", daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._threads(), self.loop).result()

    @staticmethod
    async def _threads() -> None:
        import anyio.to_thread

        anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS

    def __call__(self, request: ForwardedRequest, node: str) -> ForwardedResponse:
        future = asyncio.run_coroutine_threadsafe(self._call(request, node), self.loop)
        return future.result()

    async def _call(self, request: ForwardedRequest, node: str) -> ForwardedResponse:
        try:
            return await asyncio.wait_for(self._asgi(request, node), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _error(504, "the pool's head did not answer this request in time")

    async def _asgi(self, request: ForwardedRequest, node: str) -> ForwardedResponse:
        path, _, query = request.target.partition("?")
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        headers += [(b"host", b"gpuswap"), (b"content-length", str(len(request.body)).encode())]
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": unquote(path), "raw_path": path.encode("latin-1"),
            "query_string": query.encode("latin-1"), "root_path": "", "headers": headers,
            "client": None, "server": None,
            SCOPE_KEY: (request.pid, request.uid, request.gid), ORIGIN_KEY: node,
        }
        sent = False
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await never.wait()      # the client stays connected until the answer is complete
            return {"type": "http.disconnect"}

        status, out_headers, body = 500, [], bytearray()

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, out_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                out_headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("a request forwarded by node %s failed", node)
            return _error(500, "internal error at the pool's head (see its log)")
        return ForwardedResponse(status, tuple(out_headers), bytes(body))


def _error(status: int, detail: str) -> ForwardedResponse:
    import json

    return ForwardedResponse(status, (("content-type", "application/json"),), json.dumps({"detail": detail}).encode())
