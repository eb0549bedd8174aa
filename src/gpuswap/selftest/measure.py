"""What the selftest measures, from public sources only: NVML's per-process list as the daemon
serves it (`GET /v1/gpus`: real NVML on real GPUs, the simulated device's list on simulated ones),
/proc (through psutil) for process trees and host memory, the job's events for the daemon's own
timing of each move, and a plain pinned copy of the same bytes for comparison.

Host RAM of a park is the job's process tree's resident set (VmRSS, summed) during the park minus
before it. Pinned host memory counts there (as RssShmem); so do the driver's host copies of a
frozen process, which live in that process. MemAvailable's drop is recorded beside it, but it is
the whole machine's and moves with everything else running.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil

from gpuswap.api.client import Client


@dataclass
class Reading:
    """One look at a job's process tree."""

    pids: list[int]                       # the tree: the root and its descendants, alive now
    nvml_bytes: Optional[int]             # NVML memory of those pids, all GPUs; None: NVML did not say
    nvml_processes: list[tuple[int, Optional[int]]]   # (pid, bytes) NVML lists among them
    rss_bytes: int                        # VmRSS summed over the tree
    mem_available: int                    # MemAvailable, whole machine


def tree(root: int) -> list[int]:
    """`root` and every descendant alive now (empty if root is gone)."""
    try:
        p = psutil.Process(root)
        return [root] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def read(client: Client, root: int, also: Optional[list[int]] = None) -> Reading:
    """NVML and RSS of the tree under `root`, plus any of the pids `also` still alive (a process
    of the tree seen earlier that left it)."""
    pids = sorted(set(tree(root)) | {p for p in also or [] if psutil.pid_exists(p)})
    listed: list[tuple[int, Optional[int]]] = []
    for g in client.get("/v1/gpus")["gpus"]:
        listed += [(p["pid"], p["used_bytes"]) for p in g["processes"] if p["pid"] in pids]
    nvml = None if any(b is None for _, b in listed) else sum(b or 0 for _, b in listed)
    return Reading(pids, nvml, listed, _rss(pids), psutil.virtual_memory().available)


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


# -- the daemon's own timing of each move, from the job's events -------------------------------
_PARK = {
    "ram": re.compile(r"^parked in RAM: .* in (?P<a>\d+(?:\.\d+)?) s"),
    "disk": re.compile(r"^parked to disk: checkpoint of .* written in (?P<a>\d+(?:\.\d+)?) s"),
    "transparent": re.compile(r"^frozen transparently.*\(lock (?P<a>\d+(?:\.\d+)?) s, "
                              r"checkpoint (?P<b>\d+(?:\.\d+)?) s\)"),
}
_RESUME = {
    "ram": re.compile(r"^resumed from RAM in (?P<a>\d+(?:\.\d+)?) s"),
    "disk": re.compile(r"^restarted from its disk checkpoint at step \d+ \(.* read in (?P<a>\d+(?:\.\d+)?) s\)"),
    "transparent": re.compile(r"^thawed.*: restore (?P<a>\d+(?:\.\d+)?) s, unlock (?P<b>\d+(?:\.\d+)?) s"),
}
_RESTARTED = re.compile(r"^restarted from its disk checkpoint at step (\d+)")
EVENT_RESOLUTION_S = 0.005     # events give seconds to two decimals


def _seconds(events: list[dict[str, Any]], pattern: re.Pattern[str]) -> Optional[float]:
    """The first matching event's seconds (lock + checkpoint, restore + unlock: summed)."""
    for e in events:
        m = pattern.search(e.get("reason") or "")
        if m:
            return sum(float(v) for v in m.groupdict().values() if v is not None)
    return None


def move_seconds(events: list[dict[str, Any]], kind: str) -> tuple[Optional[float], Optional[float]]:
    """(park seconds, resume seconds) as the daemon recorded them for a `kind` move."""
    return _seconds(events, _PARK[kind]), _seconds(events, _RESUME[kind])


def restarted_at(events: list[dict[str, Any]]) -> Optional[int]:
    """The step of the disk checkpoint the job was restarted from, if it was."""
    for e in events:
        m = _RESTARTED.search(e.get("reason") or "")
        if m:
            return int(m.group(1))
    return None


# -- the plain copy to compare with ----------------------------------------------------------
@dataclass
class PlainCopy:
    kind: str                        # what was timed, in words
    nbytes: int
    d2h_s: Optional[float] = None    # device -> host (what a park moves), best of the repeats
    h2d_s: Optional[float] = None    # host -> device (what a resume moves)
    alloc_s: Optional[float] = None  # allocating (and pinning) the host buffer, once
    error: str = ""
    simulated: bool = False


REPEATS = 3


def plain_copy(nbytes: int, simulated: bool, gpu_uuid: Optional[str], env: dict[str, str],
               timeout: float = 600) -> PlainCopy:
    """On a real GPU, pinned copies of `nbytes` in a child process pinned to that GPU (so this
    process never holds a CUDA context); on simulated GPUs, a host memcpy here."""
    if simulated:
        return _host_memcpy(nbytes)
    kind = "pinned host<->device copies (torch; 256 MiB host buffers, one device buffer)"
    env = dict(env, CUDA_VISIBLE_DEVICES=gpu_uuid or "", CUDA_DEVICE_ORDER="PCI_BUS_ID")
    try:
        r = subprocess.run([sys.executable, "-m", "gpuswap.selftest.pinned", str(nbytes), str(REPEATS)],
                           env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return PlainCopy(kind, nbytes, error=f"the pinned copy did not finish within {timeout:.0f} s")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return PlainCopy(kind, nbytes, error=f"the pinned copy failed: {last}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return PlainCopy(kind, nbytes, d["d2h_s"], d["h2d_s"], d["alloc_s"])


def _host_memcpy(nbytes: int) -> PlainCopy:
    """A host memcpy (memoryview slice assignment is one memcpy) into a fresh buffer: what a
    simulated park does. Labelled as such: no device is involved."""
    nbytes = max(1, nbytes)
    t0 = time.perf_counter()
    src = bytearray(b"\x01") * nbytes
    dst = bytearray(nbytes)
    alloc = time.perf_counter() - t0
    s, d = memoryview(src), memoryview(dst)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        d[:] = s
        best = min(best, time.perf_counter() - t0)
    return PlainCopy("host memcpy (simulated GPU: no device copy)", nbytes, best, best, alloc, simulated=True)


def mem_available() -> int:
    return psutil.virtual_memory().available


def filesystem_of(path: str) -> str:
    """The filesystem type holding `path` (the disk tier's), from /proc/mounts: longest mount prefix."""
    best, kind = "", "?"
    try:
        for part in psutil.disk_partitions(all=True):
            mp = part.mountpoint
            if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
                best, kind = mp, part.fstype
    except OSError:
        pass
    return kind
