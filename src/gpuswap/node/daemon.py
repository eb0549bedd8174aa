"""`gpuswap server`: one daemon per state directory, serving the API on a Unix socket.

The API itself (the app, and the Unix socket's HTTP protocol that reads the caller's uid) comes
from the layer above as a `Frontend` (api/serving.py makes it, cli/server.py hands it over):
node/ does not import api/, so the layers point one way, cli -> api -> node."""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from gpuswap.node import cuda_ckpt, pool as pool_mod
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.controller import Controller, ControllerConfig
from gpuswap.node.drivers import checkpoint_driver
from gpuswap.node.gpus import GpuInventory, detect
from gpuswap.node.homedir import HomeError, prepare, tighten_jobs
from gpuswap.node.launcher import Launcher
from gpuswap.node.nodebandwidths import NodeBandwidths
from gpuswap.node.schema import SchemaTooNew
from gpuswap.node.settings import ServerSettings
from gpuswap.node.store import Store
from gpuswap.policy.model import PolicyConfig

log = logging.getLogger("gpuswap.daemon")


class DaemonError(Exception):
    """A reason the daemon cannot start, for one clear line on stderr."""


class DaemonUnavailable(DaemonError):
    """What the daemon needs is not there (Ray not installed, its cluster not reachable): exit 69."""


@dataclass(frozen=True)
class Frontend:
    """What the daemon serves on its sockets."""

    make_app: Callable[[Store, Controller, GpuInventory, Launcher], Any]   # the ASGI app
    uds_protocol: type      # the Unix socket's HTTP protocol (it tells the app the caller's uid)
    # For a pool: the app -> what answers a request made on a node's socket, as its caller
    # (`serve(request, node)`, api/forwarded.py; node/gateway.py is the node's side).
    replayer: Optional[Callable[[Any], Callable[[Any, str], Any]]] = None


def socket_path(home: Path) -> Path:
    return home / "gpuswap.sock"


def default_ram_budget() -> int:
    """Half of physical memory: parking must never starve the machine's own processes."""
    return psutil.virtual_memory().total // 2


def _take_instance_lock(home: Path) -> int:
    fd = os.open(home / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DaemonError(f"another gpuswap daemon (pid {other}) already serves {home}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _owner(store: Store, job_id: int) -> Optional[tuple[int, int]]:
    """(uid, gid) of a job, or None for a directory with no (valid) record."""
    try:
        job = store.get(job_id)
    except (OverflowError, sqlite3.Error):
        return None
    return (job.uid, job.gid) if job else None


def _ray_pool(opts: ServerSettings) -> tuple[pool_mod.Pool, GpuInventory]:
    """The Ray cluster's nodes as the pool (node/raypool.py), and their GPUs for the API."""
    try:
        from gpuswap.node.raypool import PoolInventory, RayPool, RayUnavailable
    except ImportError as e:
        raise DaemonUnavailable(f"--ray needs Ray, which is not installed here ({e.name or e}): "
                                'pip install "gpuswap[ray]"') from None
    try:
        pool = RayPool(opts.ray or "auto", opts.pause_timeout_s, opts.node_lost_s, opts.ram_budget,
                       calibrate=opts.calibrate)
    except RayUnavailable as e:
        raise DaemonUnavailable(str(e)) from None
    return pool, PoolInventory(pool)


def _announce(line: str) -> None:
    """The start line, for whoever started us. Our output may go to a full disk or a closed pipe:
    neither may stop a daemon whose jobs' supervisors wait for it (logging already swallows the
    same errors, logging.Handler.handleError)."""
    try:
        print(line, flush=True)
    except OSError:
        pass


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def serve(home: Path, opts: ServerSettings, frontend: Frontend) -> None:
    """Serve `home` until SIGTERM or SIGINT, with settings already checked (node/settings.py).
    Jobs' supervisors are not ours to stop: they outlive this process, and the next daemon for
    `home` takes them up again (the systemd unit relies on it: KillMode=process)."""
    import uvicorn

    from gpuswap.node.listener import ListenError, TcpListener, bind, public_url
    from gpuswap.node.conn_guard import ConnectionGuard, connection_budget, guarded, quiet_accept_errors, server_limits
    from gpuswap.node.retention import RetentionSweeper

    try:
        prepare(home)                    # private whatever the umask; an old loose home tightened
        lock_fd = _take_instance_lock(home)
    except HomeError as e:
        raise DaemonError(str(e)) from None
    except OSError as e:
        raise DaemonError(f"cannot use {home} as the state directory (GPUSWAP_HOME): "
                          f"{e.strerror or e}") from None
    try:
        tcp_sock = bind(opts.listen) if opts.listen else None
    except ListenError as e:
        raise DaemonError(str(e)) from None
    ray_pool = None
    if opts.ray:
        ray_pool = _ray_pool(opts)         # before the database is opened
    try:
        gpus = detect(opts.simulate_gpus) if ray_pool is None else ray_pool[1]
    except (RuntimeError, ValueError) as e:
        raise DaemonError(str(e)) from None
    try:
        store = Store(home / "state.db")
    except SchemaTooNew as e:            # a downgrade: never read what this version cannot see
        raise DaemonError(str(e)) from None
    except sqlite3.Error as e:
        raise DaemonError(f"cannot open the database {home / 'state.db'}: {e}") from None
    try:
        tighten_jobs(home, lambda job_id: _owner(store, job_id))
    except OSError as e:
        raise DaemonError(f"cannot make the job files in {home / 'jobs'} private: {e}") from None
    launcher = Launcher(home, simulated=gpus.simulated, pause_timeout_s=opts.pause_timeout_s)
    driver = checkpoint_driver(home, gpus) if ray_pool is None else cuda_ckpt.UnavailableDriver(
        ray_pool[0].capability)
    bandwidths = Bandwidths(store)   # what earlier runs learned from real moves, reloaded
    # A pool's nodes each have their own figures: calibrated by their agents (RayPool asks them
    # unless --no-calibrate), refined by their own moves, kept per node (node/nodebandwidths.py).
    node_bandwidths = (None if ray_pool is None else
                       NodeBandwidths(store, lambda: getattr(ray_pool[0], "calibrations", {})))
    # Calibration takes a second or so of disk I/O (and pinned copies on a real GPU): serve
    # meanwhile, with what is known until it lands.
    if opts.calibrate and ray_pool is None:
        threading.Thread(target=bandwidths.calibrate, args=(home, gpus.simulated), name="calibrate",
                         daemon=True).start()
    config = ControllerConfig(policy=opts.policy, pause_timeout_s=opts.pause_timeout_s, no_runtime=opts.no_runtime,
                              attach_grace_s=opts.attach_grace_s,
                              ram_budget=opts.ram_budget or default_ram_budget(),
                              policy_config=PolicyConfig(min_runtime_s=opts.min_runtime_s,
                                                         protect_multiple=opts.protect_multiple,
                                                         protect_cap_s=opts.protect_cap_s,
                                                         max_switch_fraction=opts.max_switch_fraction,
                                                         reserve_after_s=opts.reserve_after_s,
                                                         class_budget_gpu_h=opts.class_budget_gpu_h,
                                                         class_half_life_s=opts.class_half_life_s,
                                                         class_floor_share=opts.class_floor_share))
    pool = pool_mod.single(launcher, gpus, driver) if ray_pool is None else ray_pool[0]
    controller = Controller(store, launcher, pool, config, bandwidths, node_bandwidths=node_bandwidths)
    app = frontend.make_app(store, controller, gpus, launcher)
    app.state.public_url = public_url(tcp_sock) if tcp_sock else None
    if ray_pool is not None and frontend.replayer is not None:
        ray_pool[0].serve_forwarded(frontend.replayer(app))     # `gpuswap` on every node's socket
    # Connections within the fd limit, idle ones timed out, EMFILE logged once (conn_guard.py).
    quiet_accept_errors()
    cap = connection_budget(2 if tcp_sock else 1)
    uds_guard = ConnectionGuard(f"the Unix socket {socket_path(home)}", cap)
    tcp = TcpListener(app, tcp_sock, ConnectionGuard(f"--listen {opts.listen}", cap)) if tcp_sock else None
    sweeper = (RetentionSweeper(store, launcher, opts.retention_s, pool=pool) if opts.retention_s is not None
               else None)

    sock = socket_path(home)
    if sock.exists():
        sock.unlink()       # stale: we hold the instance lock, so nobody else serves it
    stop = threading.Event()
    loop_thread = threading.Thread(target=controller.run, args=(stop,), name="controller", daemon=True)
    loop_thread.start()
    _announce(f"gpuswap daemon {os.getpid()}: {gpus.describe()}; policy {opts.policy}; "
              f"listening on {sock}" + (f" and {app.state.public_url} (bearer tokens)" if tcp else ""))
    if tcp:
        tcp.start()
    if sweeper:
        sweeper.start()
    dcgm = None
    if opts.dcgm_job_mapping_dir and ray_pool is None:
        from gpuswap.node.dcgm import MappingWriter

        dcgm = MappingWriter(opts.dcgm_job_mapping_dir, lambda: store.list(live_only=True),
                             lambda: [g.index for g in gpus.list()])
        dcgm.start()
    server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), http=guarded(frontend.uds_protocol, uds_guard),
                                           lifespan="off", log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2, **server_limits(uds_guard)))
    # uvicorn stops gracefully on SIGTERM, then raises the signal again under the handler it found:
    # under the default one the process died right there, skipping the cleanup below. This one
    # ends serve() through it, and the process exits 0 (`systemctl stop`: a clean stop).
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server.run()
    finally:
        if sweeper:
            sweeper.stop()
        if tcp:
            tcp.stop()
        if dcgm:
            dcgm.stop()
        stop.set()
        controller.wake()       # out of its wait between ticks now, not up to a tick later
        if ray_pool is not None:
            ray_pool[0].stop()
        loop_thread.join(timeout=5)
        store.close()
        os.close(lock_fd)
