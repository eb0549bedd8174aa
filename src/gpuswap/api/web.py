"""The routes that let people see and steer the node: overview, log tail, tokens, metrics, dashboard.

Mounted on the core app by `mount()`, so they share its Authorizer and therefore its rules: a
non-admin sees others' jobs only as the overview shows them and gets 404 for anything else.
"""
from __future__ import annotations

from pathlib import Path as FsPath
from typing import Annotated, Any, Optional

from fastapi import Body, Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from pydantic import BaseModel, Field, field_validator
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gpuswap.api.auth import SCOPE_KEY, Authorizer, Caller
from gpuswap.api.joblog import read_log
from gpuswap.api.metrics import GpuswapCollector
from gpuswap.api.overview import build_overview
from gpuswap.api.tokens import TokenBook
from gpuswap.api.views import NO_JOB, JobId, errors
from gpuswap.node.controller import Controller
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.launcher import Launcher
from gpuswap.node.store import Store
from gpuswap.printable import printable

STATIC = FsPath(__file__).parent / "static"
TAIL_MAX = 1 << 16
# The dashboard's assets are all local and it builds its DOM without inline script or style, so
# the page may load and run nothing but its own files: a job name or log line that slipped into
# the page as HTML still could not run script. It cannot be framed (its buttons act on jobs).
DASHBOARD_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
                 "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                 "frame-ancestors 'none'")


class SecurityHeaders:
    """Pure ASGI middleware (no buffering, so long polls and streams are untouched): every
    response is `nosniff`, so a log tail or job output served as text/plain or octet-stream is
    never sniffed into HTML; the dashboard's pages also get the CSP above and no framing."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        ui = path == "/" or path == "/ui" or path.startswith("/ui/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["X-Content-Type-Options"] = "nosniff"
                if ui:
                    headers["Content-Security-Policy"] = DASHBOARD_CSP
                    headers["X-Frame-Options"] = "DENY"
                    headers["Referrer-Policy"] = "no-referrer"
            await send(message)

        await self.app(scope, receive, send_with_headers)


class TokenRequest(BaseModel):
    # An empty name is refused, not read as "the caller": a script's unset variable must not mint
    # the caller's own token where another user's was meant.
    user: Optional[str] = Field(default=None, min_length=1, max_length=64,
                                description="admins only: another user's token (omit it for your own)")
    note: str = Field(default="", max_length=200)
    for_dashboard: bool = Field(default=False, description="create it only if the daemon has a TCP listener "
                                "(409 otherwise), so a dashboard URL can be made from it")

    @field_validator("note")
    @classmethod
    def _note_printable(cls, note: str) -> str:
        # `token ls` shows notes in a table, an admin's of every user's: as a job's name, no
        # control characters (a newline broke the row; an escape sequence would reach the terminal).
        if printable(note) != note:
            raise ValueError("note contains control characters (escape sequences, newlines, tabs, ...)")
        return note


def mount(app: FastAPI, store: Store, controller: Controller, gpus: GpuInventory, launcher: Launcher,
          authorizer: Authorizer) -> None:
    book: TokenBook = authorizer.tokens or TokenBook(store)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuswapCollector(store, controller, gpus))

    def caller(request: Request) -> Caller:
        return authorizer.caller(request)

    @app.get("/v1/overview")
    def overview(who: Caller = Depends(caller)) -> dict[str, Any]:
        return build_overview(store, controller, gpus, who)

    @app.get("/v1/jobs/{job_id}/log/tail", response_class=Response, responses={
        200: {"content": {"text/plain": {}}, "description": "the last `size` bytes of the job's output, "
              "as text/plain (with nosniff: never rendered as HTML)"}, **errors(e404=NO_JOB)})
    def log_tail(job_id: JobId, size: int = Query(8192, ge=1, le=TAIL_MAX),
                 who: Caller = Depends(caller)) -> Response:
        job = store.get(job_id)
        if job is None or not who.may_act_on(job.uid):
            raise HTTPException(404, f"no job {job_id}")
        return PlainTextResponse(read_log(controller.pool, job, None, size))   # text/plain; charset=utf-8

    @app.post("/v1/tokens", status_code=201)
    def create_token(request: Request, req: TokenRequest = Body(default_factory=TokenRequest),
                     who: Caller = Depends(caller)) -> dict[str, Any]:
        if request.scope.get(SCOPE_KEY) is None:
            raise HTTPException(403, "tokens are created over the daemon's Unix socket, where the kernel "
                                     "says who you are; run `gpuswap token create` on the server")
        user = who.user if req.user is None else req.user
        if user != who.user and not who.admin:
            raise HTTPException(403, "only admins can create a token for another user")
        url = getattr(app.state, "public_url", None)
        if req.for_dashboard and not url:   # refused before a token exists: none is left behind
            raise HTTPException(409, "the daemon has no TCP listener, so there is no dashboard URL; "
                                     "start it with `gpuswap server --listen HOST:PORT`")
        try:
            token, record = book.create(user, created_by=who.user, note=req.note)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {**record, "token": token, "url": url,
                "dashboard_url": f"{url}/ui/#token={token}" if url else None}

    @app.get("/v1/tokens")
    def list_tokens(who: Caller = Depends(caller)) -> list[dict[str, Any]]:
        return book.list(None if who.admin else who.uid)

    @app.delete("/v1/tokens/{token_id}")
    def revoke_token(token_id: Annotated[str, Path(max_length=64)], who: Caller = Depends(caller)) -> dict[str, Any]:
        mine = [t for t in book.list(None if who.admin else who.uid) if t["id"] == token_id]
        if not mine or not book.revoke(token_id):
            raise HTTPException(404, f"no token {printable(token_id)}")   # the client's bytes, shown, not sent
        return {"revoked": token_id}

    @app.get("/metrics", include_in_schema=True, response_class=Response)
    def metrics(who: Caller = Depends(caller)) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/ui", include_in_schema=False)
    def ui_slash() -> RedirectResponse:
        # Relative, as above: the mount's own redirect named the request's Host (and a forwarded
        # scheme) in its Location, which a forged Host could point anywhere.
        return RedirectResponse("/ui/")

    app.mount("/ui", StaticFiles(directory=STATIC, html=True), name="ui")
    app.add_middleware(SecurityHeaders)
