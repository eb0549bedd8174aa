"""Prepare a park's host buffers when the pause is *asked*, not when the job reaches its safepoint.

A job's first park is slow because its host buffers are fresh: the kernel zeroes every page as
it is faulted in and `cudaHostRegister` then pins it (runtime/pinned.py). On an H100 that made a
cold park 0.29x the bandwidth of a plain pinned copy, a warm one (slabs reused) 0.96x. The pause
arrives on the control thread while the training thread is still inside its step, up to one
iteration before the safepoint: that time used to be lost. Now the control thread takes a lease
from the pool right away, sized to what the last measurement of the job found (`reach.measure`,
recorded on the training thread: no other thread may walk the tensors); the pool's worker
threads map, fault in and pin its slabs while the step finishes, and the park at the safepoint
takes that lease instead of asking the pool afresh.

Rules, each the pool's own (nothing new to keep in step with it):
- only `HostPool.take`, `give_back`: the CUDA calls stay on the pool's worker and release
  threads under the device guard they already use, never on the training thread, never for a
  GPU the job does not use (`reach.Measured.device` is the park's own choice of device);
- a park whose storages are not the ones expected (the job grew, a storage was freed) gives the
  prepared lease back and takes what it needs: the idle slabs are reused first fit, the rest is
  new, exactly as a park after an earlier park does. The bytes are always the park's own;
- a pause withdrawn (resume before the safepoint, a park that fails or is refused, the job's
  end) gives the lease back: its slabs go idle and are released after `GPUSWAP_PINNED_KEEP_S`,
  like those of a park that ended;
- only what the park itself would hold: the expected bytes, laid out as a park lays them out,
  and nothing when the pause will not copy (a RAM pause over the job's RAM cap with no
  checkpoint directory fails instead).

The preparation uses CPU (the page zeroing: ~13 GB/s with 8 threads on the H100 host) while
the step finishes, and can slow that step (16 GiB: 1.57x a GPU-bound step in one of two runs;
docs/runtime.md); `GPUSWAP_PREFAULT=0` turns it off for a job whose step needs every core.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from gpuswap.protocol.env import PREFAULT
from gpuswap.runtime.pinned import HostPool, Lease


@dataclass(frozen=True)
class Expected:
    """What a park is expected to ask the pool for: storage sizes, in the park's order, and the
    device whose context pins them (None: a simulated GPU)."""

    sizes: tuple[int, ...]
    device: Optional[int]


@dataclass
class PrefaultStats:
    prepared: int = 0    # leases taken ahead of a park
    used: int = 0        # ... that the park took as they were
    redone: int = 0      # ... given back because the park's storages differed (reused as idle slabs)
    withdrawn: int = 0   # ... given back because no park came


@dataclass
class _Ahead:
    lease: Lease
    expected: Expected


_lock = threading.Lock()
_ahead: "weakref.WeakKeyDictionary[HostPool, _Ahead]" = weakref.WeakKeyDictionary()
_stats: "weakref.WeakKeyDictionary[HostPool, PrefaultStats]" = weakref.WeakKeyDictionary()


def enabled(env: Any = os.environ) -> bool:
    """Off only where `GPUSWAP_PREFAULT` is "0"."""
    return env.get(PREFAULT, "1").strip() != "0"


def prepare(pool: HostPool, expected: Expected) -> bool:
    """Take a lease for `expected` now (any thread; it returns at once: the pool's workers map,
    fault in and pin). False if one is already prepared or nothing is expected."""
    if not expected.sizes:
        return False
    with _lock:
        if pool in _ahead:
            return False
        _ahead[pool] = _Ahead(pool.take(list(expected.sizes), expected.device), expected)
        _stats.setdefault(pool, PrefaultStats()).prepared += 1
    return True


def take(pool: HostPool, sizes: list[int], device: Optional[int]) -> Lease:
    """The park's lease: the prepared one if it is exactly what the park needs, else the pool's
    (reusing the prepared slabs as idle ones)."""
    with _lock:
        ahead = _ahead.pop(pool, None)
        if ahead is not None:
            same = ahead.expected == Expected(tuple(sizes), device)
            stats = _stats.setdefault(pool, PrefaultStats())
            if same:
                stats.used += 1
            else:
                stats.redone += 1
    if ahead is None:
        return pool.take(sizes, device)
    if same:
        return ahead.lease
    pool.give_back(ahead.lease)   # waits for its pins: they are the slabs `take` reuses now
    return pool.take(sizes, device)


def withdraw(pool: HostPool, wait: bool = False) -> bool:
    """No park will take the prepared lease: give it back (its pins may still be under way, so
    on a thread of its own unless `wait`). True if there was one."""
    with _lock:
        ahead = _ahead.pop(pool, None)
        if ahead is not None:
            _stats.setdefault(pool, PrefaultStats()).withdrawn += 1
    if ahead is None:
        return False
    if wait:
        pool.give_back(ahead.lease)
    else:
        threading.Thread(target=pool.give_back, args=(ahead.lease,), name="gpuswap-prefault-withdraw",
                         daemon=True).start()
    return True


def pending(pool: HostPool) -> Optional[Lease]:
    """The lease prepared for the next park, if any (tests, benchmarks)."""
    with _lock:
        ahead = _ahead.get(pool)
        return ahead.lease if ahead is not None else None


def stats(pool: HostPool) -> PrefaultStats:
    with _lock:
        s = _stats.get(pool)
        return PrefaultStats(**vars(s)) if s is not None else PrefaultStats()
