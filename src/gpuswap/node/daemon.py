"""`gpuswap server`: one daemon per state directory, serving the API on a Unix socket."""
from __future__ import annotations

import fcntl
import logging
import math
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from gpuswap.node import cuda_ckpt
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.controller import Controller, ControllerConfig
from gpuswap.node.cuda_ckpt import CheckpointDriver
from gpuswap.node.gpus import GpuInventory, NvmlGpus, SimulatedGpus, detect
from gpuswap.node.homedir import HomeError, prepare, tighten_jobs
from gpuswap.node.launcher import Launcher
from gpuswap.node.schema import SchemaTooNew
from gpuswap.node.store import Store
from gpuswap.policy.model import PolicyConfig

log = logging.getLogger("gpuswap.daemon")


class DaemonError(Exception):
    """A reason the daemon cannot start, for one clear line on stderr."""


class OptionError(DaemonError):
    """The daemon was started with options it cannot run with (a usage error: exit 64)."""


@dataclass
class ServerOptions:
    home: Path
    simulate_gpus: Optional[str] = None
    policy: str = "gpuswap"
    min_runtime_s: float = 60.0
    max_switch_fraction: float = 0.2
    pause_timeout_s: float = 60.0
    no_runtime: str = "wait"
    ram_budget: Optional[int] = None
    admin_group: Optional[str] = "gpuswap-admin"
    listen: Optional[str] = None      # HOST:PORT for a TCP listener with bearer tokens
    dcgm_job_mapping_dir: Optional[Path] = None   # dcgm-exporter --hpc-job-mapping-dir
    retention_s: Optional[float] = 30 * 86400     # forget finished jobs this long after they end; None: never
    calibrate: bool = True            # time disk and RAM moves at start (bandwidth.py)


def check_options(opts: ServerOptions) -> None:
    """Refuse options the daemon could not honour, before it touches its home: an unknown policy
    would otherwise fail every controller tick and leave every job PENDING for good."""
    from gpuswap.policy import LIVE_POLICIES, POLICIES

    if opts.policy not in LIVE_POLICIES:
        why = ("needs each job's true remaining time, so it runs only in the simulator (gpuswap sim)"
               if opts.policy in POLICIES else "is not a policy")
        raise OptionError(f"--policy {opts.policy!r} {why}; choose one of: {', '.join(LIVE_POLICIES)}")
    for flag, value in (("--min-runtime", opts.min_runtime_s), ("--pause-timeout", opts.pause_timeout_s),
                        ("--max-switch-fraction", opts.max_switch_fraction)):
        if not math.isfinite(value) or value < 0:
            raise OptionError(f"{flag} {value:g} must be a finite number >= 0")
    if opts.retention_s is not None and not (math.isfinite(opts.retention_s) and opts.retention_s >= 0):
        raise OptionError(f"--retention {opts.retention_s:g} must be a finite number of seconds >= 0")
    if opts.ram_budget is not None and opts.ram_budget < 0:
        raise OptionError(f"--ram-budget {opts.ram_budget} must be >= 0 bytes")
    if opts.simulate_gpus is not None:
        try:
            SimulatedGpus.parse(opts.simulate_gpus)
        except ValueError as e:
            raise OptionError(str(e)) from None
    if opts.listen is not None:
        from gpuswap.node.listener import ListenError, parse_listen

        try:   # an unreadable address is a usage error; one that cannot be bound (taken) is not
            parse_listen(opts.listen)
        except ListenError as e:
            raise OptionError(str(e)) from None


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


def checkpoint_driver(home: Path, gpus: GpuInventory) -> CheckpointDriver:
    """The driver checkpoint API for transparent parking: simulated with simulated GPUs, else the
    real one if this node's driver and cuda-bindings support it (else one that says why not)."""
    if isinstance(gpus, NvmlGpus):
        cap = cuda_ckpt.detect(gpus.persistence(), gpus.driver)
        if cap.available:
            try:
                return cuda_ckpt.CudaCheckpointDriver(cap)
            except Exception as e:   # cuInit failing: report it, run without transparent parking
                cap = cuda_ckpt.Capability(False, f"cuInit failed: {e}", driver=gpus.driver)
        return cuda_ckpt.UnavailableDriver(cap)
    from gpuswap.node.simdriver import SimulatedCheckpointDriver
    from gpuswap.simcuda import SimDevice

    assert isinstance(gpus, SimulatedGpus)
    gpus.device = SimDevice(sim_device_dir(home))      # its NVML process list shows what the driver did
    return SimulatedCheckpointDriver(gpus, gpus.device)


def sim_device_dir(home: Path) -> Path:
    """Where simulated CUDA processes register and the simulated driver keeps its record."""
    return home / "simulated-driver"


def serve(opts: ServerOptions) -> None:
    import uvicorn

    from gpuswap.api.app import create_app
    from gpuswap.api.auth import Authorizer, PeerCredProtocol
    from gpuswap.api.tokens import TokenBook
    from gpuswap.node.listener import ListenError, TcpListener, bind, public_url
    from gpuswap.node.conn_guard import ConnectionGuard, connection_budget, guarded, quiet_accept_errors, server_limits
    from gpuswap.node.retention import RetentionSweeper

    check_options(opts)
    home = opts.home
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
    try:
        gpus = detect(opts.simulate_gpus)
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
    driver = checkpoint_driver(home, gpus)
    bandwidths = Bandwidths(store)   # what earlier runs learned from real moves, reloaded
    # Calibration takes a second or so of disk I/O (and pinned copies on a real GPU): serve
    # meanwhile, with what is known until it lands.
    if opts.calibrate:
        threading.Thread(target=bandwidths.calibrate, args=(home, gpus.simulated), name="calibrate",
                         daemon=True).start()
    config = ControllerConfig(policy=opts.policy, pause_timeout_s=opts.pause_timeout_s,
                              policy_config=PolicyConfig(min_runtime_s=opts.min_runtime_s,
                                                         max_switch_fraction=opts.max_switch_fraction), no_runtime=opts.no_runtime,
                              ram_budget=opts.ram_budget or default_ram_budget())
    controller = Controller(store, launcher, gpus, config, driver, bandwidths)
    app = create_app(store, controller, gpus, launcher, Authorizer(opts.admin_group, TokenBook(store)))
    app.state.public_url = public_url(tcp_sock) if tcp_sock else None
    # Connections within the fd limit, idle ones timed out, EMFILE logged once (conn_guard.py).
    quiet_accept_errors()
    cap = connection_budget(2 if tcp_sock else 1)
    uds_guard = ConnectionGuard(f"the Unix socket {socket_path(home)}", cap)
    tcp = TcpListener(app, tcp_sock, ConnectionGuard(f"--listen {opts.listen}", cap)) if tcp_sock else None
    sweeper = RetentionSweeper(store, launcher, opts.retention_s) if opts.retention_s is not None else None

    sock = socket_path(home)
    if sock.exists():
        sock.unlink()       # stale: we hold the instance lock, so nobody else serves it
    stop = threading.Event()
    loop_thread = threading.Thread(target=controller.run, args=(stop,), name="controller", daemon=True)
    loop_thread.start()
    print(f"gpuswap daemon {os.getpid()}: {gpus.describe()}; policy {opts.policy}; "
          f"listening on {sock}" + (f" and {app.state.public_url} (bearer tokens)" if tcp else ""), flush=True)
    if tcp:
        tcp.start()
    if sweeper:
        sweeper.start()
    dcgm = None
    if opts.dcgm_job_mapping_dir:
        from gpuswap.node.dcgm import MappingWriter

        dcgm = MappingWriter(opts.dcgm_job_mapping_dir, lambda: store.list(live_only=True),
                             lambda: [g.index for g in gpus.list()])
        dcgm.start()
    server = uvicorn.Server(uvicorn.Config(app, uds=str(sock), http=guarded(PeerCredProtocol, uds_guard),
                                           lifespan="off", log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2, **server_limits(uds_guard)))
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
        loop_thread.join(timeout=5)
        store.close()
        os.close(lock_fd)
