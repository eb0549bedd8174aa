"""The daemon's HTTP API. Handlers record intent durably and wake the controller; they never move
a job between states themselves, so there is one writer of state transitions."""
from __future__ import annotations

import os
import time
from typing import Any, Optional

import anyio.to_thread
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

import gpuswap
from gpuswap.api import schema, storage_errors
from gpuswap.api.auth import ORIGIN_KEY, Authorizer, Caller
from gpuswap.api.joblog import log_path, read_log
from gpuswap.api.limits import BodyLimit, page_headers
from gpuswap.api.longpoll import Ticks
from gpuswap.api.overview import gpu_used, holders_of, kept_on, ram_budget, ram_by_node
from gpuswap.api.sizes import MAX_PAGE_JOBS, PAGE_ARGV_BYTES
from gpuswap.api.views import NO_JOB, JobId, PauseRequest, SubmitRequest, errors, gpu_record, job_record
from gpuswap.jobs import JobState, Priority, format_size, parse_size
from gpuswap import lifecycle
from gpuswap.lifecycle import EventKind as K, NewEvent
from gpuswap.node.controller import Controller
from gpuswap.node.freezer import deferred_pause_text
from gpuswap.node.gpus import GpuInventory
from gpuswap.node.launcher import Launcher, cwd_problem
from gpuswap.node.store import JobRecord, NewJob, Store
from gpuswap.policy.estimate import RECENT, estimate

MAX_WAIT_S = 30.0
LOG_CHUNK = 1 << 20


def json_media_type(content_type: str) -> bool:
    """Whether a Content-Type says JSON (application/json, or an application/...+json type): the
    bodies FastAPI parses as JSON (not those without a Content-Type: its strict content type)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def freezing(job: JobRecord) -> bool:
    """A freeze through the CUDA driver under way (a pause without the job's runtime)."""
    return job.state == JobState.PAUSING and job.mechanism == "transparent"


def create_app(store: Store, controller: Controller, gpus: GpuInventory, launcher: Launcher,
               authorizer: Authorizer) -> FastAPI:
    # No /docs or /redoc: they load scripts from a CDN on the dashboard's origin, where the
    # dashboard keeps its token (sessionStorage). The schema itself is at /openapi.json.
    app = FastAPI(title="gpuswap", version=gpuswap.__version__, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        kind = request.headers.get("content-type")
        if (tuple(first.get("loc", ())) == ("body",) and first.get("type") != "missing"
                and not json_media_type(kind or "")):
            # Sent as another type (curl -d's form type, text/plain) or none: FastAPI parses only a
            # JSON type as JSON, and "Input should be a valid dictionary" blamed a body that may
            # well be valid JSON.
            got = f"not {kind[:80]!r}" if kind else "and it has no Content-Type"
            return JSONResponse({"detail": f"invalid request: the body must be sent as JSON "
                                           f"(Content-Type: application/json), {got}"}, 415)
        if first.get("type") == "json_invalid":   # not JSON text: 400, as a body that is not UTF-8 is
            why = (first.get("ctx") or {}).get("error", "")
            return JSONResponse({"detail": f"invalid request: the body is not JSON{': ' + str(why) if why else ''}"},
                                400)
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = str(first["msg"]).removeprefix("Value error, ")     # our validators' sentences, as written
        return JSONResponse({"detail": f"invalid request: {where + ': ' if where else ''}{msg}"}, 422)

    storage_errors.install(app)   # a full disk is a 507, not a 500
    schema.install(app)           # the OpenAPI schema says what is really answered; 405s carry Allow

    def record(job: JobRecord, events: Any = None, log_path: Any = None) -> dict[str, Any]:
        return job_record(job, time.time(), events, log_path, gpus_simulated=gpus.simulated,
                          wait=controller.wait_of(job))

    def caller(request: Request) -> Caller:
        return authorizer.caller(request)

    def own_job(job_id: int, who: Caller) -> JobRecord:
        job = store.get(job_id)
        if job is None or not who.may_act_on(job.uid):
            # Another user's job is reported as absent: its existence is not theirs to know.
            raise HTTPException(404, f"no job {job_id}")
        return job

    def working_dir_problem(request: Request, cwd: str, who: Caller) -> Optional[str]:
        """Checked as the caller, by the kernel, on the machine they submitted from: this one, or
        the pool node whose socket forwarded the request (api/forwarded.py)."""
        origin = request.scope.get(ORIGIN_KEY)
        if origin is None:
            return cwd_problem(cwd, who.uid, who.gid)
        try:
            return controller.pool.on(origin).cwd_problem(cwd, who.uid, who.gid)
        except Exception as e:
            raise HTTPException(503, f"cannot check the working directory on node {origin}: "
                                     f"{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}") from None

    ticks = Ticks(controller.changed)

    async def wait_for(job_id: int, done: Any, timeout: float) -> JobRecord:
        """The job once `done(job)`, or at the timeout (MAX_WAIT_S at most). Only the controller's
        ticks move jobs, so it looks again after each; it holds a worker thread only for each
        look (api/longpoll.py: a sleeping handler held one for all of its wait)."""
        deadline = time.monotonic() + min(timeout, MAX_WAIT_S)
        with ticks.watching() as ticked:
            while True:
                ticked.clear()       # before the look: a tick during it is not missed
                job = await anyio.to_thread.run_sync(store.get, job_id)
                if job is None:      # forgotten meanwhile (--retention)
                    raise HTTPException(404, f"no job {job_id}")
                left = deadline - time.monotonic()
                if done(job) or left <= 0:
                    return job
                with anyio.move_on_after(left):
                    await ticked.wait()

    @app.get("/v1/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "version": gpuswap.__version__, "pid": os.getpid(),
                "simulated": gpus.simulated, "gpus": gpus.describe(), "policy": controller.config.policy}

    @app.post("/v1/jobs", status_code=201)
    def submit(req: SubmitRequest, request: Request, who: Caller = Depends(caller)) -> dict[str, Any]:
        try:
            prio = Priority.parse(req.priority)
            mem = parse_size(str(req.mem)) if req.mem is not None else 0
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        devices = gpus.list()
        per_node: dict[Optional[str], int] = {}
        for d in devices:
            per_node[d.node] = per_node.get(d.node, 0) + 1
        most = max(per_node.values(), default=0)
        if req.gpus > most:      # a job runs on one node (a pool's GPUs name theirs)
            raise HTTPException(400, f"asks for {req.gpus} GPUs; this node has {most}" if None in per_node or
                                not per_node else f"asks for {req.gpus} GPUs; the largest node of the pool has {most}")
        if mem and devices and mem > max(d.mem_total for d in devices):
            raise HTTPException(400, f"asks for {format_size(mem)} per GPU; the largest GPU here has "
                                     f"{format_size(max(d.mem_total for d in devices))}")
        if who.uid != os.geteuid() and os.geteuid() != 0:
            raise HTTPException(403, "this daemon does not run as root, so it can only run jobs as "
                                     "its own user; ask an admin to run `gpuswap server` as root")
        problem = working_dir_problem(request, req.cwd, who)
        if problem:
            raise HTTPException(400, problem)
        name = req.name or os.path.basename(req.argv[0])
        # Its runtime estimate, once, from what finished before it (the simulator's rule too).
        est = estimate(req.time_limit_s, *store.finished_runs(who.uid, name, RECENT))
        [job_id] = store.add_jobs([NewJob(name=name, user=who.user, uid=who.uid, gid=who.gid, argv=req.argv,
                                          cwd=req.cwd, env=req.env, priority=int(prio), gpus=req.gpus,
                                          mem_bytes=mem, preemptible=req.preemptible,
                                          pause_mode=req.pause_mode, time_limit_s=req.time_limit_s,
                                          estimate_s=est.seconds if est else None,
                                          estimate_from=est.source if est else None,
                                          estimate_runs=est.runs if est else 0)], time.time())
        controller.wake()
        return {"id": job_id, "name": name, "state": JobState.PENDING.value}

    @app.get("/v1/jobs")
    def list_jobs(response: Response, all_users: bool = Query(False, alias="all"),
                  limit: int = Query(MAX_PAGE_JOBS, ge=1, le=MAX_PAGE_JOBS, description="most jobs in the page"),
                  before: Optional[int] = Query(None, ge=1, le=2**62, description="the newest jobs below this id"),
                  after: Optional[int] = Query(None, ge=0, le=2**62, description="the oldest jobs above this id"),
                  who: Caller = Depends(caller)) -> list[dict]:
        """One page of jobs in id order: the newest `limit` (below `before`), or with `after` the
        oldest above it. X-Next-Before / X-Next-After say where the next page starts, if any.
        One cursor at most: the two walk in opposite directions, so both together mean nothing."""
        if before is not None and after is not None:
            raise HTTPException(422, "invalid request: give one cursor, `before` or `after`, not both")
        if all_users and not who.admin:
            raise HTTPException(403, "only admins can list every user's jobs")
        uid = None if all_users else who.uid
        jobs, more = store.page(uid, limit, before=before, after=after, max_bytes=PAGE_ARGV_BYTES)
        response.headers.update(page_headers(more, jobs, after, store.count(uid)))
        now = time.time()
        return [job_record(j, now, gpus_simulated=gpus.simulated, wait=controller.wait_of(j)) for j in jobs]

    @app.get("/v1/jobs/{job_id}", responses=errors(e404=NO_JOB))
    def show(job_id: JobId, who: Caller = Depends(caller)) -> dict[str, Any]:
        with store.at_one_instant():      # the record and its events as of one instant
            job = own_job(job_id, who)
            events = store.events(job_id)
        return record(job, events, log_path(controller.pool, job, launcher))

    @app.get("/v1/jobs/{job_id}/wait", responses=errors(e404=NO_JOB))
    async def wait(job_id: JobId, timeout: float = Query(MAX_WAIT_S, ge=0, le=86400),
                   who: Caller = Depends(caller)) -> dict[str, Any]:
        """The job once it has ended, or as it is after `timeout` seconds (30 at most)."""
        await anyio.to_thread.run_sync(own_job, job_id, who)
        return record(await wait_for(job_id, lambda j: j.state.terminal, timeout))

    @app.get("/v1/jobs/{job_id}/log", response_class=Response, responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the log's bytes from `offset` "
              "(at most 1 MiB); headers X-Next-Offset and X-Job-State"}, **errors(e404=NO_JOB)})
    def logs(job_id: JobId, offset: int = Query(0, ge=0, le=2**62), who: Caller = Depends(caller)) -> Response:
        job = own_job(job_id, who)
        data = read_log(controller.pool, job, offset, LOG_CHUNK)
        return Response(data, media_type="application/octet-stream",
                        headers={"X-Next-Offset": str(offset + len(data)),
                                 "X-Job-State": job.state.value})

    @app.post("/v1/jobs/{job_id}/cancel", responses=errors(e404=NO_JOB, e409="the job already ended"))
    async def cancel(job_id: JobId, who: Caller = Depends(caller)) -> dict[str, Any]:
        def ask() -> None:
            job = own_job(job_id, who)
            if not lifecycle.may_cancel(job.state):
                raise HTTPException(409, f"job {job_id} already ended ({job.state.value})")
            if not job.cancel_requested:
                try:
                    store.update(job_id, time.time(), cancel_requested=True, hold=False, event=NewEvent(
                        K.CANCEL_REQUESTED, f"cancel requested by {who.user}", initiator="user"))
                except lifecycle.RequestTooLate as e:     # it ended since it was read
                    raise HTTPException(409, f"job {job_id} already ended ({e.state.value})") from None
            controller.wake()

        await anyio.to_thread.run_sync(ask)
        return record(await wait_for(job_id, lambda j: j.state.terminal, 2.0))

    @app.post("/v1/jobs/{job_id}/pause", responses=errors(
        e400="an unknown tier (use ram or disk)", e404=NO_JOB,
        e409="refused, with the reason: the job is not started, cannot be parked (no safepoint reached, "
             "or no tier it can be parked to), or the controller declined the pause"))
    async def pause(job_id: JobId, req: PauseRequest, who: Caller = Depends(caller)) -> dict[str, Any]:
        """Hold the job paused (to ram or disk). A job already held paused is left as it is: 200 with
        `nothing_done` saying so (the CLI prints it on stderr and exits 0)."""
        def ask() -> tuple[bool, Optional[dict[str, Any]]]:
            """(whether it is a spill to disk, the answer if there is nothing to do)."""
            job = own_job(job_id, who)
            if req.to not in ("ram", "disk"):
                raise HTTPException(400, f"cannot pause to {req.to!r}; use ram or disk")
            if not lifecycle.may_pause(job.state):
                raise HTTPException(409, f"job {job_id} is {job.state.value}; only a started job can be paused")
            if job.no_runtime:
                raise HTTPException(409, f"job {job_id} cannot be parked: it reached no safepoint when last asked "
                                         f"(no gpuswap runtime attached, or none within the pause timeout)")
            spill = job.state == JobState.PAUSED and job.parked == "ram" and req.to == "disk"
            if job.hold and (not spill or "disk" in (job.hold_tier, job.desired_tier)):
                where = f"parked {'on disk' if job.parked == 'disk' else 'in RAM'}" if job.parked else "held"
                done = (f"job {job_id} already has a spill to disk under way; nothing to do" if spill else
                        f"job {job_id} is already paused ({where}); nothing to do" if job.state == JobState.PAUSED
                        else f"job {job_id} already has a pause under way ({job.state.value}); nothing to do")
                return spill, {**record(job), "nothing_done": done}
            # Only the user's intent is written (hold, and the tier asked for); the controller turns it
            # into the pause or the spill, and answers here by moving the job or refusing the request.
            try:
                store.update(job_id, time.time(), hold=True, hold_tier=req.to, event=NewEvent(
                    K.PAUSE_REQUESTED, f"spill to disk requested by {who.user}" if spill
                    else f"pause to {req.to} requested by {who.user}", tier=req.to, initiator="user"))
            except lifecycle.RequestTooLate as e:         # it ended since it was read
                raise HTTPException(409, f"job {job_id} is {e.state.value}; only a started job can be paused") from None
            controller.wake()
            return spill, None

        spill, nothing_done = await anyio.to_thread.run_sync(ask)
        if nothing_done is not None:
            return nothing_done
        if spill:
            # Answered once the controller asked the job's supervisor (desired_tier), or refused it
            # (hold_tier back to RAM); the spill itself takes as long as the checkpoint does.
            job = await wait_for(job_id, lambda j: j.desired_tier == "disk" or j.hold_tier != "disk" or not j.hold
                                 or j.parked != "ram", 2.0)
            if job.parked == "ram" and job.hold and job.hold_tier != "disk":
                raise HTTPException(409, f"job {job_id}: {job.reason}")
            return record(job)
        # The controller either starts the pause (the job leaves RUNNING) or refuses it, which
        # drops the hold with the reason: a refusal is a failed request, not a success.
        # A job whose runtime has not attached yet keeps the request (deferred, with its event).
        job = await wait_for(job_id, lambda j: j.state != JobState.RUNNING or not j.hold
                             or j.reason == deferred_pause_text(j.hold_tier or "ram", controller.config.attach_grace_s),
                             2.0)
        if freezing(job):
            # A freeze through the driver is waited out: it is refused at once where the driver has
            # nothing to freeze (no CUDA process in the job), and that refusal came after the
            # answer, which said PAUSING (exit 0). A freeze still copying at MAX_WAIT_S is answered
            # as it stands.
            job = await wait_for(job_id, lambda j: not freezing(j) or not j.hold, MAX_WAIT_S)
        if job.state == JobState.RUNNING and not job.hold and not job.cancel_requested:
            raise HTTPException(409, f"job {job_id}: {job.reason}")
        return record(job)

    @app.post("/v1/jobs/{job_id}/resume", responses=errors(e404=NO_JOB, e409="the job is pending or ended"))
    def resume(job_id: JobId, who: Caller = Depends(caller)) -> dict[str, Any]:
        """Drop the user's hold. A job no user holds (running, or paused by the scheduler) is left as it
        is: 200 with `nothing_done` saying so (the CLI prints it on stderr and exits 0)."""
        job = own_job(job_id, who)
        if not lifecycle.may_resume(job.state):
            raise HTTPException(409, f"job {job_id} is {job.state.value}; only a paused job can be resumed")
        if not job.hold:   # nothing of the user's to undo: say so rather than succeed silently
            done = (f"job {job_id} is already {job.state.value.lower()}; nothing to resume"
                    if job.state in (JobState.RUNNING, JobState.RESUMING) else
                    f"job {job_id} is {job.state.value} by the scheduler, not held by a user; it resumes on "
                    "its own when its GPUs are free; nothing to resume")
            return {**record(job), "nothing_done": done}
        # A hold on a job still running is a pause not yet under way (deferred until its runtime
        # attaches): dropping it leaves the job running, which the sentence says.
        then = ("its pause had not begun: it keeps running" if job.state == JobState.RUNNING
                else "it runs when its GPUs are free")
        try:
            store.update(job_id, time.time(), hold=False, event=NewEvent(
                K.RESUME_REQUESTED, f"resume requested by {who.user}; {then}", initiator="user"))
        except lifecycle.RequestTooLate as e:             # it ended since it was read
            raise HTTPException(409, f"job {job_id} is {e.state.value}; only a paused job can be resumed") from None
        controller.wake()
        return record(store.get(job_id) or job)

    @app.get("/v1/gpus")
    def list_gpus(who: Caller = Depends(caller)) -> dict[str, Any]:
        devices = gpus.list()
        live = store.list(live_only=True)
        holders = holders_of(live)
        kept = kept_on(live)       # RAM-parked jobs' residue: listed on its GPU, counted as used
        now = time.time()
        out = []
        for g in devices:
            jobs = holders.get((g.node, g.index), [])
            here = kept.get((g.node, g.index), [])
            used = gpu_used(g.mem_used, jobs, sum(n for _, n in here))
            out.append(gpu_record(g, used, [
                {"id": j.id, "state": j.state.value, "user": j.user if who.may_act_on(j.uid) else "(other)",
                 "name": j.name if who.may_act_on(j.uid) else "", "time_in_state_s": now - j.state_since,
                 "residue_bytes": n}
                for j, n in [(j, 0) for j in jobs] + here]))
        parked_ram = sum(j.parked_bytes for j in live if j.parked == "ram")
        ram_nodes = ram_by_node(controller, devices, live)      # a pool's: each node parks in its own RAM
        cap = controller.capability
        # A pool's nodes each have their own figures (node/nodebandwidths.py): every node's that
        # answers, GPUs or none; "bandwidths" is then what a job not placed on a node is priced with.
        per_node = ({} if controller.node_bandwidths is None else
                    {"node_bandwidths": controller.node_bandwidths.describe(controller.pool.last)})
        return {"simulated": gpus.simulated, "description": gpus.describe(), "gpus": out,
                "ram_budget": ram_budget(controller, ram_nodes), "ram_parked": parked_ram, "ram_nodes": ram_nodes,
                "policy": controller.config.policy,
                "transparent": {"available": cap.available, "description": cap.reason, "driver": cap.driver,
                                "bindings": cap.bindings, "migration": cap.migration,
                                "persistence_mode": cap.persistence, "simulated": cap.simulated,
                                "criu": cap.criu},
                "bandwidths": controller.bandwidths.describe(), **per_node}

    from gpuswap.api.web import mount   # overview, tokens, /metrics, dashboard (issue 6)

    mount(app, store, controller, gpus, launcher, authorizer)
    app.add_middleware(BodyLimit)   # outermost: a huge body is refused before anything reads it
    return app
