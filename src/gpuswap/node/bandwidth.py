"""Switch-cost bandwidths measured on this machine, not assumed, handed to the policy as its
SwitchCosts. Every figure carries its source, which `gpuswap gpus` shows:

  default      SwitchCosts' constant: nothing better is known yet
  calibrated   timed at daemon start, off the start path: a 128 MiB write+fsync and read in the
               home (disk tier); on real GPUs pinned host<->device copies of 256 MiB through the
               CUDA driver (RAM tier; needs cuda-bindings), on simulated ones a host memcpy;
               skipped under `gpuswap server --no-calibrate`
  measured     refined from real parks, resumes and checkpoints (exponentially weighted)
  learned      refined from real moves before the daemon's last restart: the figures are kept in
               SQLite and reloaded at start, so a restart does not forget what the machine did

Two figures are seconds, not bandwidths: a multi-rank job's process-group teardown before a RAM
park and rebuild after its resume (the slowest rank's, as the ranks report them). Their defaults
are SwitchCosts' orders of magnitude; real multi-rank parks replace them.

A figure from real moves is never replaced by a calibration: it describes the jobs' own moves.

In a pool (docs/ray.md) each node is calibrated by its own agent, which reports its figures
(`calibrated()`) to the head; the head keeps one `Bandwidths` per node (node/nodebandwidths.py),
takes the report in (`take_calibration`) and folds in the real moves made on that node.
"""
from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from gpuswap.policy.model import SwitchCosts

log = logging.getLogger("gpuswap.bandwidth")

CALIBRATION_BYTES = 128 * 2**20
# The disk calibration writes into the home's filesystem, which jobs' checkpoints share: it takes
# at most this share of what is free, so it never fills a nearly full disk. (It wrote until
# ENOSPC on a 16 MiB home: for a moment nothing else could write there, neither a job's
# checkpoint nor the daemon's own first line, and the daemon died of it in CI.)
CALIBRATION_FREE_SHARE = 0.1
MIN_DISK_CALIBRATION_BYTES = 16 * 2**20    # less measures a write's fixed costs, not a bandwidth
DISK_BLOCK = 4 * 2**20
PINNED_CALIBRATION_BYTES = 256 * 2**20
SMOOTHING = 0.3            # weight of a new observation
MIN_OBSERVED_BYTES = 16 * 2**20   # smaller moves are dominated by fixed costs, not bandwidth
# No move of a job's memory is faster than this (H100 HBM3 is 3.35 TB/s on the device itself; a
# host<->device copy tops out near 0.45 TB/s even over Grace Hopper's NVLink-C2C). A report above
# it is a lie or a broken clock: folded in, it would make every later switch look free.
MAX_PLAUSIBLE_BPS = 1e12
CALIBRATED = "calibrated"      # how a calibration's source begins (and nothing else's)
MAX_SOURCE = 200               # characters of a reported source kept


@dataclass
class Measured:
    value: float           # bytes/s
    source: str            # "default" | "calibrated: ..." | "measured: N real move(s)" | "learned: ..."
    samples: int = 0       # real moves folded in (persisted ones included)


class BandwidthBook(Protocol):
    """Where learned figures are kept across restarts (the daemon's Store)."""

    def load_bandwidths(self) -> dict[str, tuple[float, int]]: ...

    def save_bandwidth(self, field: str, bytes_per_s: float, samples: int, now: float) -> None: ...


class Bandwidths:
    FIELDS = ("ram_park_bps", "ram_resume_bps", "disk_write_bps", "disk_read_bps")
    SECONDS = ("group_teardown_s", "group_rebuild_s")     # seconds per switch, not bytes/s
    MAX_PLAUSIBLE_S = 3600.0    # a group made in more than an hour is a broken clock, not a figure

    def __init__(self, book: Optional[BandwidthBook] = None) -> None:
        base = SwitchCosts()
        self._lock = threading.Lock()
        self._book = book
        self.m: dict[str, Measured] = {f: Measured(getattr(base, f), "default") for f in self.FIELDS + self.SECONDS}
        self._costs: Optional[SwitchCosts] = None     # made again only when a figure changes
        for field, (value, samples) in (book.load_bandwidths() if book else {}).items():
            if field in self.m and value > 0 and samples > 0:
                self.m[field] = Measured(value, f"learned: {samples} real move(s) before the last restart", samples)

    def calibrate(self, home: Path, simulated: bool, cuda: Any = None,
                  clock: Callable[[], float] = time.perf_counter) -> None:
        """Disk write/read through this home's filesystem; for the RAM tier, pinned copies through
        the CUDA driver on real GPUs (`cuda`: the cuda.bindings.driver module, or a stand-in with
        its own `clock`), a host memcpy on simulated ones. A figure that cannot be calibrated keeps
        what it has."""
        try:
            measured = _disk_bandwidth(home)
        except OSError:
            measured = None
        if measured is not None:
            w, r, nbytes = measured
            self._set("disk_write_bps", w, f"calibrated: {nbytes // 2**20} MiB write+fsync in the home")
            self._set("disk_read_bps", r, f"calibrated: {nbytes // 2**20} MiB read in the home")
        if simulated:
            bps = _memcpy_bandwidth()
            self._set("ram_park_bps", bps, "calibrated: host memcpy, simulated GPU")
            self._set("ram_resume_bps", bps, "calibrated: host memcpy, simulated GPU")
            return
        try:
            park, resume = pinned_copy_bandwidth(cuda, clock=clock)
        except CudaUnavailable as e:
            log.info("RAM-tier bandwidths not calibrated: %s", e)
            return
        size = f"{PINNED_CALIBRATION_BYTES // 2**20} MiB"
        self._set("ram_park_bps", park, f"calibrated: pinned device->host copy of {size}")
        self._set("ram_resume_bps", resume, f"calibrated: pinned host->device copy of {size}")

    def observe(self, field: str, nbytes: int, seconds: Optional[float]) -> None:
        """Fold in one real move of `nbytes` that took `seconds`, and keep the result durably."""
        if not seconds or seconds <= 0 or nbytes < MIN_OBSERVED_BYTES:
            return
        bps = nbytes / seconds
        if bps > MAX_PLAUSIBLE_BPS:
            log.warning("ignored an implausible %s move: %d bytes in %g s", field, nbytes, seconds)
            return
        self._fold(field, bps)

    def observe_seconds(self, field: str, seconds: Optional[float]) -> None:
        """Fold in one real multi-rank group teardown or rebuild that took `seconds`."""
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds <= self.MAX_PLAUSIBLE_S:
            return
        self._fold(field, float(seconds))

    def _fold(self, field: str, observed: float) -> None:
        """Exponentially weighted, and kept durably."""
        with self._lock:
            m = self.m[field]
            n = m.samples + 1
            value = observed if m.samples == 0 else (1 - SMOOTHING) * m.value + SMOOTHING * observed
            self.m[field] = Measured(value, f"measured: {n} real move(s)", n)
            self._costs = None
        if self._book is not None:
            try:
                self._book.save_bandwidth(field, value, n, time.time())
            except sqlite3.Error as e:   # the figure still serves this run; only its memory is lost
                log.warning("could not save the %s figure: %s", field, e)

    def _set(self, field: str, value: float, source: str) -> None:
        with self._lock:
            if self.m[field].samples == 0:
                self.m[field] = Measured(value, source)
                self._costs = None

    def calibrated(self) -> dict[str, dict[str, object]]:
        """The figures a calibration set, with their sources: what a pool node's agent reports."""
        with self._lock:
            return {f: {"bytes_per_s": m.value, "source": m.source} for f, m in self.m.items()
                    if f in self.FIELDS and m.source.startswith(CALIBRATED)}

    def take_calibration(self, figures: Any) -> list[str]:
        """A calibration made elsewhere (a pool node's agent, as `calibrated()` gave it), taken in
        as one made here: it never replaces a figure from real moves. Read as untrusted: only the
        bandwidths this class knows, each a plausible number with a calibration's source; anything
        else is dropped. Returns the fields taken."""
        taken: list[str] = []
        if not isinstance(figures, dict):
            return taken
        for field, figure in figures.items():
            if field not in self.FIELDS or not isinstance(figure, dict):
                continue
            value, source = figure.get("bytes_per_s"), figure.get("source")
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or not 0 < value <= MAX_PLAUSIBLE_BPS or not isinstance(source, str)
                    or not source.startswith(CALIBRATED)):
                continue
            self._set(field, float(value), source[:MAX_SOURCE])
            taken.append(field)
        return taken

    def costs(self) -> SwitchCosts:
        """The policy's costs: the same object until a figure changes (the policy keeps its
        arithmetic per costs object, policy/costs.py)."""
        with self._lock:
            if self._costs is None:
                self._costs = replace(SwitchCosts(), **{f: m.value for f, m in self.m.items()})
            return self._costs

    def describe(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {f: {("seconds" if f in self.SECONDS else "bytes_per_s"): m.value, "source": m.source,
                        "samples": m.samples} for f, m in self.m.items()}


# -- calibrations ------------------------------------------------------------------------------
class CudaUnavailable(Exception):
    """No pinned-copy calibration here: no cuda-bindings, no usable GPU, or a driver call failed."""


def pinned_copy_bandwidth(cuda: Any = None, nbytes: int = PINNED_CALIBRATION_BYTES,
                          ordinal: int = 0, repeats: int = 3,
                          clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(device->host, host->device) bytes/s of pinned copies on GPU `ordinal`, best of `repeats`:
    what a RAM park and resume move at. Through the CUDA driver API (cuda.bindings.driver), never
    torch: the daemon must not import it. Every cuda-bindings call returns a tuple whose first
    element is the CUresult. The primary context is released afterwards, so the daemon keeps no
    GPU memory; a GPU too full for the buffers (a job survived the restart) raises CudaUnavailable.
    `clock`: what the copies are timed with (a test double of the driver brings its own)."""
    if cuda is None:
        try:
            from cuda.bindings import driver as cuda
        except Exception as e:   # not installed, or its native part fails to load
            raise CudaUnavailable(f"cuda-bindings is not usable ({e})") from None

    def call(name: str, *args: Any) -> Any:
        result = getattr(cuda, name)(*args)
        err = result[0] if isinstance(result, tuple) else result
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise CudaUnavailable(f"{name} failed: {getattr(err, 'name', err)}")
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def quietly(name: str, *args: Any) -> None:   # clean-up: a failure must not hide the first one
        try:
            call(name, *args)
        except CudaUnavailable as e:
            log.info("calibration clean-up: %s", e)

    call("cuInit", 0)
    dev = call("cuDeviceGet", ordinal)
    ctx = call("cuDevicePrimaryCtxRetain", dev)
    try:
        call("cuCtxPushCurrent", ctx)
        host = dptr = None
        try:
            host = call("cuMemHostAlloc", nbytes, 0)
            dptr = call("cuMemAlloc", nbytes)
            # Both copies are synchronous for pinned memory; the synchronize is belt and braces.
            h2d = _best(lambda: (call("cuMemcpyHtoD", dptr, host, nbytes), call("cuCtxSynchronize")), repeats,
                        clock)
            d2h = _best(lambda: (call("cuMemcpyDtoH", host, dptr, nbytes), call("cuCtxSynchronize")), repeats,
                        clock)
        finally:
            if dptr is not None:
                quietly("cuMemFree", dptr)
            if host is not None:
                quietly("cuMemFreeHost", host)
            quietly("cuCtxPopCurrent")
    finally:
        quietly("cuDevicePrimaryCtxRelease", dev)
    return nbytes / d2h, nbytes / h2d


def _best(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Shortest of `repeats` timed runs (the first pays one-time costs), never 0."""
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


def _memcpy_bandwidth() -> float:
    """A host memcpy (memoryview slice assignment is one memcpy); both buffers are touched first so
    the timed copies measure copying, not page faults."""
    src = bytearray(b"\x01") * CALIBRATION_BYTES
    dst = bytearray(CALIBRATION_BYTES)
    s, d = memoryview(src), memoryview(dst)
    d[:] = s
    return CALIBRATION_BYTES / _best(lambda: d.__setitem__(slice(None), s), 3)


def disk_calibration_bytes(free: int) -> int:
    """How much the disk calibration writes where `free` bytes are free: 0 to skip it."""
    nbytes = min(CALIBRATION_BYTES, int(free * CALIBRATION_FREE_SHARE)) // DISK_BLOCK * DISK_BLOCK
    return nbytes if nbytes >= MIN_DISK_CALIBRATION_BYTES else 0


def _disk_bandwidth(home: Path) -> Optional[tuple[float, float, int]]:
    """(write, read) bytes/s and the bytes written, or None where the disk has too little room."""
    st = os.statvfs(home)
    nbytes = disk_calibration_bytes(st.f_bavail * st.f_frsize)
    if not nbytes:
        log.info("disk bandwidths not calibrated: %d MiB free in %s, and the calibration takes at most "
                 "%d%% of it", st.f_bavail * st.f_frsize // 2**20, home, round(CALIBRATION_FREE_SHARE * 100))
        return None
    path = home / ".calibration"
    block = os.urandom(DISK_BLOCK)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)         # the daemon's, whatever the umask (random bytes, but still)
        with open(fd, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            while f.read(len(block)):
                pass
        read = nbytes / (time.perf_counter() - t0)   # page cache: an upper bound
    finally:
        path.unlink(missing_ok=True)
    return write, read, nbytes
