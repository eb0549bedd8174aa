"""Keep the OpenAPI schema truthful about what the API answers, and 405s RFC-correct.

FastAPI documents a 422 body (`HTTPValidationError`, a list) that our handler never sends (it sends
one sentence, `ErrorDetail`), and it cannot know the refusals raised from shared code: 401 from
the bearer-token check, 400 for a body that is not JSON text, 415 for one sent as another media
type, 413 for one over the size limit (api/limits.py), 507 for a full disk. These are
added here by rule; refusals particular to one operation are listed in EXTRA (the routes' own
`responses=` say the rest). A client generated from the schema, or a conformance fuzzer
(tests/web/test_schema_fuzz.py), then sees only documented statuses and bodies.

Starlette answers a method that a path does not serve with 405 and an `Allow` header naming only
the first route on that path; `allow_all_methods` names every method the path serves. FastAPI's
routes serve only the methods they name, so HEAD was a 405 everywhere: `HeadAsGet` serves it.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuswap.api.views import ErrorDetail

ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorDetail"}}}
EXTRA: dict[tuple[str, str], dict[int, str]] = {
    ("post", "/v1/jobs"): {400: "an unknown priority, an unreadable or too large `mem`, or more GPUs than the node has",
                           403: "a daemon not running as root runs jobs only for its own user"},
    ("get", "/v1/jobs"): {403: "`all=true` from a caller who is not an admin"},
    ("post", "/v1/tokens"): {400: "no such user on this machine",
                             403: "not over the Unix socket, or a token for another user by a non-admin",
                             409: "`for_dashboard` on a daemon without a TCP listener"},
    ("delete", "/v1/tokens/{token_id}"): {404: "no such token, or another user's"},
}


def _needs_caller(route: APIRoute) -> bool:
    return any(getattr(d.call, "__name__", "") == "caller" for d in route.dependant.dependencies)


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        authed = {(m.lower(), r.path) for r in app.routes if isinstance(r, APIRoute) and _needs_caller(r)
                  for m in r.methods}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})

                def add(code: int, why: str) -> None:
                    responses.setdefault(str(code), {"description": why, "content": ERROR})

                if "422" in responses:
                    responses["422"] = {"description": "invalid request: the first problem, as one sentence",
                                        "content": ERROR}
                if "requestBody" in op:
                    add(400, "the body is not JSON text (e.g. not UTF-8)")
                    add(415, "the body is sent as another media type than JSON (`Content-Type`)")
                    add(413, "the body is larger than the API accepts (docs/limits.md)")
                if (method, path) in authed:
                    add(401, "over TCP: no valid `Authorization: Bearer` token")
                if method in ("post", "delete", "put", "patch"):
                    add(507, "the daemon's disk is full; nothing was changed")
                for code, why in EXTRA.get((method, path), {}).items():
                    add(code, why)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        schemas.setdefault("ErrorDetail", ErrorDetail.model_json_schema())
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.add_middleware(HeadAsGet)

    @app.exception_handler(StarletteHTTPException)
    async def allow_all_methods(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:
            methods: set[str] = set()
            for route in app.router.routes:
                match, _ = route.matches(request.scope)
                if match != Match.NONE:
                    methods |= set(getattr(route, "methods", None) or ())
            if "GET" in methods:
                methods.add("HEAD")             # served as GET (`HeadAsGet`)
            if methods:
                exc.headers = {**(exc.headers or {}), "Allow": ", ".join(sorted(methods))}
        return await http_exception_handler(request, exc)


class HeadAsGet:
    """Pure ASGI middleware: HEAD is answered as GET would be, without the content (RFC 9110
    9.3.2: "identical to GET except that the server MUST NOT send content"): `curl -I` and the
    monitors that probe `/v1/health` with HEAD got a 405. The GET's headers are kept, its length
    included, as the RFC allows; the server (uvicorn, told HEAD) frames no body."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_content(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_content)
