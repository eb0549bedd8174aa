"""A pool of a Ray cluster's nodes (docs/ray.md): the head's side. Imported only by `--ray`.

Ray gives what a cluster layer must: membership (`ray.nodes()`), placing one agent per node and
keeping it alive (a detached, named actor with `NodeAffinitySchedulingStrategy(soft=False)` and
`max_restarts=-1`), remote calls, and failure detection (a call to a dead agent raises). gpuswap
adds no socket or protocol of its own between the head and its nodes.

Every call is bounded by CALL_TIMEOUT_S: a node that does not answer costs its own jobs a tick
(the controller's per-job isolation), never the loop. Membership is looked at again every
MEMBERSHIP_S: an agent is made for a node that joined, without a restart; a node that left takes
its GPUs out of the pool, and its jobs out of the snapshot, until it answers again.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpuswap.node.agent import NodeAgent
from gpuswap.node.cuda_ckpt import Capability
from gpuswap.node.gpus import GpuInfo, GpuInventory
from gpuswap.node.launcher import Observation, log_file
from gpuswap.node.pool import Node, Pool
from gpuswap.node.records import JobRecord
from gpuswap.node.transition import Effect, Transition
from gpuswap.node.workdirs import WorkdirChecks
from gpuswap.protocol.forwarded import ForwardedRequest, ForwardedResponse
from gpuswap.protocol.rundir import Desired

log = logging.getLogger("gpuswap.raypool")

NAMESPACE = "gpuswap"
CALL_TIMEOUT_S = 30.0
MEMBERSHIP_S = 2.0
RETRY_S = 60.0          # a node whose agent failed to start is tried again this much later
# A node's socket (node/gateway.py): its agent's forwarding calls have their own threads there
# (a Ray concurrency group), so a long poll never waits behind, nor delays, a tick's calls.
FORWARD_GROUP = "forward"
FORWARD_THREADS = 8
# What users' requests ask of a node (a working directory checked, a log read: a user's slow mount
# can make them slow) and the retention sweep's deletions (a user's tree) have groups of their own:
# neither may hold the threads the head's ticks or the node's socket need.
USER_GROUP, USER_THREADS = "user", 4
SWEEP_GROUP, SWEEP_THREADS = "sweep", 1
USER_CALL_S = 10.0
TAKE_WAIT_S = 5.0
MAX_FORWARDED = 64      # forwarded requests the head serves at once (a `wait` holds one up to 30 s)
STALE_S = 20.0          # a request that waited this long for a thread is answered 503, not carried out
Serve = Callable[[ForwardedRequest, str], ForwardedResponse]
# Transparent parking is each node's own (its driver, its GPUs): a job is frozen through its node's
# agent when that node can (node/pool.py's driver steps); before an agent answers, nothing can.
NOT_YET = Capability(False, "no node's gpuswap agent has answered yet")


class RayUnavailable(Exception):
    """The Ray cluster cannot be reached (one line for `gpuswap server`)."""


def agent_name(node_id: str) -> str:
    return f"gpuswap-agent-{node_id}"


def _token_auth() -> bool:
    """Whether Ray's token authentication (Ray 2.52 and later) is on, as this process joined."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:        # an older Ray: none to turn on
        return False
    try:
        return bool(is_token_auth_enabled())
    except Exception:
        return False


class RayNode(Node):
    """A node of the pool, through its agent's actor."""

    def __init__(self, name: str, node_id: str, handle: Any, info: dict[str, Any]):
        self.name, self.node_id, self.handle, self.info = name, node_id, handle, info
        self.calibrating: Any = None     # the agent's calibration() call in flight, if any
        self.calibrated = False          # its agent's calibration was taken

    def _call(self, method: str, *args: Any) -> Any:
        return ray.get(getattr(self.handle, method).remote(*args), timeout=CALL_TIMEOUT_S)

    def gpus(self) -> list[GpuInfo]:
        return self._call("gpus")

    def launch(self, job: JobRecord, env: dict[str, str], generation: int, gpus: Sequence[int],
               desired: Desired) -> None:
        self._call("launch", job, env, generation, list(gpus), desired)

    def spawned(self, job_id: int, generation: int) -> bool:
        return self._call("spawned", job_id, generation)

    def set_desired(self, job_id: int, generation: int, desired: Desired) -> None:
        self._call("set_desired", job_id, generation, desired)

    def observe(self, job: JobRecord) -> observe.Facts:
        return self._call("observe", job)

    def has_cuda_process(self, job: JobRecord) -> bool:
        return self._call("has_cuda_process", job)

    def driver_step(self, step: str, job: JobRecord, obs: Observation, now: float) -> Optional[Transition]:
        return self._call("driver_step", step, job, obs, now)

    def effect(self, job_id: int, effect: Effect) -> None:
        self._call("effect", job_id, effect)

    def cwd_problem(self, cwd: str, uid: int, gid: int) -> Optional[str]:
        return self._group_call(USER_GROUP, USER_CALL_S, "cwd_problem", cwd, uid, gid)

    def read_log(self, job_id: int, offset: Optional[int], size: int) -> bytes:
        return self._group_call(USER_GROUP, USER_CALL_S, "read_log", job_id, offset, size)

    def log_path(self, job_id: int) -> str:
        return str(log_file(Path(self.info["home"]), job_id))

    def live_runs(self) -> list[tuple[int, int]]:
        return self._call("live_runs")

    def last_checkpoint(self, job_id: int, width: int = 1) -> Optional[tuple[int, int]]:
        found = self._call("last_checkpoint", job_id, width)
        return None if found is None else (int(found[0]), int(found[1]))

    def forget(self, job_id: int) -> bool:
        return self._group_call(SWEEP_GROUP, CALL_TIMEOUT_S, "forget", job_id)

    def _forward_call(self, method: str, *args: Any) -> Any:
        return self._group_call(FORWARD_GROUP, CALL_TIMEOUT_S, method, *args)

    def _group_call(self, group: str, timeout: float, method: str, *args: Any) -> Any:
        call = getattr(self.handle, method).options(concurrency_group=group)
        return ray.get(call.remote(*args), timeout=timeout)


class RayPool(Pool):
    """The nodes of the Ray cluster at `address` ("auto": the one this machine belongs to)."""

    def __init__(self, address: str, pause_timeout_s: float, lost_after_s: float = 600.0,
                 ram_budget: Optional[int] = None, calibrate: bool = True):
        super().__init__([], NOT_YET)
        # Each node's switch-cost calibration, made by its agent (`--no-calibrate`: never asked):
        # node name -> its figures, read by the head's node/nodebandwidths.py.
        self.calibrate = calibrate
        self.calibrations: dict[str, dict[str, Any]] = {}
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailable(f"cannot join the Ray cluster at {address}: {str(e).splitlines()[0]}") from None
        if not _token_auth():
            log.warning("the Ray cluster does not require its token (RAY_AUTH_MODE=token is not set): anyone who "
                        "can reach its ports can run code as the user Ray runs as on every node, and so act as "
                        "any gpuswap user; see docs/ray.md, Security")
        self._agent = ray.remote(concurrency_groups={FORWARD_GROUP: FORWARD_THREADS, USER_GROUP: USER_THREADS,
                                                      SWEEP_GROUP: SWEEP_THREADS})(NodeAgent)
        self._serve: Optional[Serve] = None
        self._stop = threading.Event()
        self._executor = ThreadPoolExecutor(MAX_FORWARDED, thread_name_prefix="forwarded")
        self._busy = threading.BoundedSemaphore(MAX_FORWARDED)    # requests taken and not yet answered
        self.pause_timeout_s = pause_timeout_s
        self._pending: dict[str, tuple[Any, Any]] = {}    # node id -> (actor, its info() call)
        self._by_id: dict[str, RayNode] = {}
        self._failed: dict[str, float] = {}    # node id -> when its agent last failed to start
        self._looked = 0.0
        self.lost_after_s = lost_after_s
        self._alive: set[str] = set()            # Ray's alive node ids at the last look
        self._missing: dict[str, float] = {}     # node name -> since when no alive node answers to it
        self._storage: dict[str, str] = {}       # node name -> its shared checkpoint storage's id, once seen
        self._workdirs = WorkdirChecks(self._check_workdir, on_answer=lambda: self.notify())
        self.ram_budget_set = ram_budget          # --ram-budget: the same on every node; None: half of each one's
        self.refresh()

    def _start_agent(self, node_id: str) -> Any:
        """The node's agent: found by its name if it runs (a restarted head re-adopts it), else made."""
        return self._agent.options(
            name=agent_name(node_id), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            max_restarts=-1, max_task_retries=0, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self.pause_timeout_s)

    def refresh(self) -> None:
        """Membership: an agent for every alive node; a node that died leaves the pool."""
        self._looked = time.monotonic()
        alive = self._alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        now = time.monotonic()
        for node_id in alive - set(self._by_id) - set(self._pending):
            if now - self._failed.get(node_id, -RETRY_S) < RETRY_S:
                continue          # its agent failed to start: tried again (and said again) later
            actor = self._start_agent(node_id)
            self._pending[node_id] = (actor, actor.info.remote())
        for node_id, (actor, ref) in list(self._pending.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._pending[node_id]
            try:
                info = ray.get(ref)
            except Exception as e:   # the agent could not start there: said once per try
                self._failed[node_id] = time.monotonic()
                log.warning("node %s: its gpuswap agent did not start: %s", node_id, str(e).splitlines()[-1][:300])
                continue
            name = info["name"]
            known = self._nodes.get(name)
            if isinstance(known, RayNode) and known.node_id != node_id:
                if known.info.get("machine") and known.info.get("machine") == info.get("machine"):
                    # The same machine (its agent's state directory) under a new Ray node id: its
                    # Ray was started again before the old id was declared dead. It takes its name.
                    self._by_id.pop(known.node_id, None)
                    log.warning("node %s is back under a new Ray node id", name)
                else:                # another machine of the same name: told apart, never confused
                    name = f"{name}-{node_id[:8]}"
            node = RayNode(name, node_id, actor, info)
            self._by_id[node_id] = node
            if info.get("shared_id"):
                self._storage[name] = info["shared_id"]
            else:
                self._storage.pop(name, None)
            self.add(node)
            if self._serve is not None:
                self._start_pump(node)
            log.warning("node %s joined the pool: %s", name, info["describe"])
        for node_id in set(self._by_id) - alive:
            node = self._by_id.pop(node_id)
            self._nodes.pop(node.name, None)
            log.warning("node %s left the pool (Ray reports it dead)", node.name)
        if self.calibrate:
            self._ask_calibrations()

    def _ask_calibrations(self) -> None:
        """Ask each node that joined for its calibration (its agent makes it on a thread of its
        own, node/agent.py) and keep what comes back; never waits: a call not answered yet is
        looked at again at the next membership look, one still being made is asked again."""
        for node in list(self._by_id.values()):
            if node.calibrated:
                continue
            if node.calibrating is None:
                node.calibrating = node.handle.calibration.remote()
                continue
            ready, _ = ray.wait([node.calibrating], timeout=0)
            if not ready:
                continue
            try:
                figures = ray.get(node.calibrating)
            except Exception as e:       # its agent restarting: asked again next time
                log.warning("node %s: could not read its calibration: %s", node.name,
                            str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                figures = None
            node.calibrating = None
            if isinstance(figures, dict):
                node.calibrated = True
                self.calibrations[node.name] = figures
                log.info("node %s calibrated: %s", node.name, ", ".join(
                    f"{f} {v.get('bytes_per_s', 0) / 1e9:.1f} GB/s" for f, v in figures.items()
                    if isinstance(v, dict) and isinstance(v.get("bytes_per_s"), (int, float))) or "nothing")

    def lost(self, placed: set[str]) -> dict[str, str]:
        """A node is lost for good when no alive Ray node has answered to its name for
        `lost_after_s`: Ray reported it dead (a dead node id never comes back; a node started
        again joins with a new id and its name), or it was not seen since this head started. While
        an alive node has no agent that answered yet (starting, or failing to start), it could be
        any of them: nobody is declared lost."""
        now = time.monotonic()
        missing = {n for n in placed if n not in self._nodes}
        self._missing = {n: self._missing.get(n, now) for n in missing}
        if self._alive - set(self._by_id):
            return {}
        return {n: f"node {n} is lost: no node of the Ray cluster has answered to its name for "
                   f"{now - since:.0f} s (--node-lost-after {self.lost_after_s:g})"
                for n, since in self._missing.items() if now - since >= self.lost_after_s}

    @property
    def capability(self) -> Capability:
        """The nodes' capabilities summed up for `gpuswap gpus` and the head's own driver: each
        job is parked by its own node's (capability_of)."""
        caps = {name: self.capability_of(name) for name in sorted(self._nodes)}
        if not caps:
            return NOT_YET
        able = [n for n, c in caps.items() if c.available]
        text = "; ".join(f"{n}: {c.reason}" for n, c in caps.items())
        return Capability(bool(able), f"per node: {text}", migration=all(c.migration for c in caps.values()),
                          simulated=any(c.simulated for c in caps.values()))

    def capability_of(self, node: Optional[str]) -> Capability:
        found = self._nodes.get(node or "")
        cap = getattr(found, "info", {}).get("capability") if found is not None else None
        if isinstance(cap, Capability):
            return cap
        return Capability(False, "a job not placed on a node yet" if node is None else f"node {node} is not in the pool now")

    def ram_budget(self, node: Optional[str], default: int) -> int:
        """`--ram-budget` on every node if it was given, else half of that node's memory (as one
        machine's default is half of its own), as its agent reported it."""
        if self.ram_budget_set is not None:
            return self.ram_budget_set
        found = self._nodes.get(node or "")
        total = getattr(found, "info", {}).get("ram_total") if found is not None else None
        return int(total) // 2 if isinstance(total, int) and total > 0 else default

    def disk_nodes(self, node: str) -> tuple[str, ...]:
        """The nodes in the pool now whose agents found the same shared checkpoint storage as
        `node`'s did (remembered after `node` left: its checkpoints are on that storage); without
        shared storage, `node` alone if it is in the pool."""
        storage = self._storage.get(node)
        if storage is None:
            return (node,) if node in self._nodes else ()
        return tuple(sorted(n for n in self._nodes if self._storage.get(n) == storage))

    def serve_forwarded(self, serve: Serve) -> None:
        """Serve every node's socket (node/gateway.py) with `serve(request, node name)`: the head's
        API, replayed with the caller the node's kernel reported (api/forwarded.py)."""
        self._serve = serve
        for node in list(self._by_id.values()):
            self._start_pump(node)

    def workdirs(self, cwd: str, uid: int, gid: int) -> Optional[dict[str, Optional[str]]]:
        return self._workdirs.answers(sorted(self._nodes), cwd, uid, gid)

    def _check_workdir(self, node: str, cwd: str, uid: int, gid: int) -> Optional[str]:
        """Asked by node/workdirs.py off the tick: that node's kernel, through its agent."""
        found = self._nodes.get(node)
        if found is None:
            raise KeyError(f"node {node} is not in the pool now")
        answer = found.cwd_problem(cwd, uid, gid)
        return None if answer is None else str(answer)

    def stop(self) -> None:
        self._workdirs.stop()
        self._stop.set()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_pump(self, node: RayNode) -> None:
        threading.Thread(target=self._pump, args=(node,), name=f"forward-{node.name}", daemon=True).start()

    def _pump(self, node: RayNode) -> None:
        """Take the node's queued requests while it is in the pool; each is served on its own
        thread (a `wait` may hold one for 30 s) and answered to the agent that queued it."""
        failing = False
        while not self._stop.is_set() and self._by_id.get(node.node_id) is node:
            # Backpressure: nothing is taken while the head serves as many as it can; the agent
            # keeps them queued and answers its clients "not answering" after its own timeout.
            if not self._busy.acquire(timeout=1.0):
                continue
            self._busy.release()
            try:
                token, requests = node._forward_call("take", TAKE_WAIT_S)
                if requests:         # leased to this take: serve what the agent confirms is ours
                    ours = set(node._forward_call("ack", token, [r.id for r in requests]))
                    requests = [r for r in requests if r.id in ours]
                failing = False
            except Exception as e:       # the agent restarting, or its node away: its clients wait
                if not failing:
                    log.warning("node %s: cannot take its socket's requests (%s)", node.name,
                                str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                failing = True
                self._stop.wait(1.0)
                continue
            taken = time.monotonic()
            for request in requests:
                try:
                    self._executor.submit(self._serve_one, node, request, taken)
                except RuntimeError:     # shut down
                    return

    def _serve_one(self, node: RayNode, request: ForwardedRequest, taken: float) -> None:
        assert self._serve is not None
        self._busy.acquire()
        try:
            if time.monotonic() - taken > STALE_S:    # its client is about to give up: do nothing late
                response = ForwardedResponse(503, (("content-type", "application/json"),),
                                             b'{"detail": "the pool\'s head was too busy to start this request in '
                                             b'time; it was not carried out"}')
            else:
                response = self._serve(request, node.name)
        except Exception:
            log.exception("a request forwarded by node %s failed", node.name)
            response = ForwardedResponse(500, (("content-type", "application/json"),),
                                         b'{"detail": "internal error at the pool\'s head (see its log)"}')
        finally:
            self._busy.release()
        try:
            node._forward_call("answer", request.id, response)
        except Exception:
            pass        # its agent is gone, and the client's connection with it

    def gpus(self) -> dict[str, list[GpuInfo]]:
        if time.monotonic() - self._looked >= MEMBERSHIP_S:
            try:
                self.refresh()
            except Exception:
                log.exception("could not read the Ray cluster's membership")
        return super().gpus()


class PoolInventory(GpuInventory):
    """Every node's GPUs for the API (`gpuswap gpus`), each naming its node: as the controller's
    last tick found them (the API's threads never call the agents themselves)."""

    def __init__(self, pool: Pool):
        self.pool = pool

    @property
    def simulated(self) -> bool:     # type: ignore[override]
        return any(g.simulated for g in self.list())

    def list(self) -> list[GpuInfo]:
        from dataclasses import replace

        return [replace(g, node=name) for name, gs in sorted(self.pool.last.items()) for g in gs]

    def describe(self) -> str:
        by_node = self.pool.last
        if not by_node:
            return "a Ray cluster's pool; no node's agent has answered yet"
        total = sum(len(g) for g in by_node.values())
        sim = " (simulated: no real GPU is used)" if any(g.simulated for gs in by_node.values() for g in gs) else ""
        return f"{total} GPU(s) on {len(by_node)} node(s) of a Ray cluster{sim}"
