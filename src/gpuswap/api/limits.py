"""Size limits on what a client may send and what one listing may return (issue 10); their
numbers are in api/sizes.py.

Without them one user's six 50 MB-argv jobs made everyone's `/v1/gpus` take seconds and grew the
database for good. The limits are far above what a real job needs (docs/limits.md) and are
checked before anything is parsed or stored: a body is refused from its Content-Length, or as
soon as its streamed bytes pass the limit, so a huge request never sits in memory.
"""
from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuswap.api.sizes import (MAX_ARGV_BYTES, MAX_ARGV_ITEMS, MAX_BODY_BYTES, MAX_ENV_BYTES, MAX_ENV_VARS,
                               MAX_HEADER_BYTES, MAX_STRING_BYTES, body_too_large, size_text as _size)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_command(argv: list[str], env: dict[str, str]) -> None:
    """Refuse an argv or environment past the limits, naming which and by how much (a 422)."""
    if len(argv) > MAX_ARGV_ITEMS:
        raise PydanticCustomError("too_large", "argv has {n} arguments; the limit is {limit}",
                                  {"n": len(argv), "limit": MAX_ARGV_ITEMS})
    longest = max((_utf8_len(a) + 1 for a in argv), default=0)
    if longest > MAX_STRING_BYTES:
        raise PydanticCustomError("too_large", "an argument is {size}; the limit is {limit} (Linux's own)",
                                  {"size": _size(longest), "limit": _size(MAX_STRING_BYTES)})
    argv_bytes = sum(_utf8_len(a) + 1 for a in argv)
    if argv_bytes > MAX_ARGV_BYTES:
        raise PydanticCustomError("too_large", "argv is {size}; the limit is {limit}",
                                  {"size": _size(argv_bytes), "limit": _size(MAX_ARGV_BYTES)})
    if len(env) > MAX_ENV_VARS:
        raise PydanticCustomError("too_large", "env has {n} variables; the limit is {limit}",
                                  {"n": len(env), "limit": MAX_ENV_VARS})
    longest = max((_utf8_len(k) + _utf8_len(v) + 2 for k, v in env.items()), default=0)
    if longest > MAX_STRING_BYTES:
        raise PydanticCustomError("too_large", "an env variable is {size}; the limit is {limit} (Linux's own)",
                                  {"size": _size(longest), "limit": _size(MAX_STRING_BYTES)})
    env_bytes = sum(_utf8_len(k) + _utf8_len(v) + 2 for k, v in env.items())
    if env_bytes > MAX_ENV_BYTES:
        raise PydanticCustomError("too_large", "env is {size}; the limit is {limit}",
                                  {"size": _size(env_bytes), "limit": _size(MAX_ENV_BYTES)})


class BodyLimit:
    """Pure ASGI middleware: a body over `limit` bytes is a 413 before it is read, from its
    Content-Length, or (chunked, or a lying length) as soon as the bytes received pass the limit;
    headers over MAX_HEADER_BYTES are a 431. (h11's own 16 KiB bound applies only to headers that
    arrive in pieces: a 200 KB header read in one go passed it.)"""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    def _too_large(self) -> str:
        return body_too_large(self.limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if sum(len(name) + len(value) for name, value in headers) > MAX_HEADER_BYTES:
            response = JSONResponse({"detail": f"request headers too large: the limit is {_size(MAX_HEADER_BYTES)}"},
                                    431, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        for name, value in headers:
            if name == b"content-length":
                if value.isdigit() and int(value) > self.limit:
                    response = JSONResponse({"detail": self._too_large()}, 413, headers={"Connection": "close"})
                    await response(scope, receive, send)
                    return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI lets an HTTPException raised while reading the body through to
                    # the exception middleware, which answers it as any other refusal.
                    raise HTTPException(413, self._too_large(), headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


def page_headers(more: bool, jobs: list[Any], after: Any, total: int) -> dict[str, str]:
    """Where the next page starts: X-Next-After walking forward (`after`), else X-Next-Before."""
    headers = {"X-Total-Count": str(total)}
    if more and jobs:
        if after is not None:
            headers["X-Next-After"] = str(jobs[-1].id)
        else:
            headers["X-Next-Before"] = str(jobs[0].id)
    return headers
