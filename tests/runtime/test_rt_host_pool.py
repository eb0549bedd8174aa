"""The host-buffer pool parks use (runtime/pinned.py), on pageable memory: exact sizes,
sub-allocation, reuse across parks, release on a background thread, and the fallback to pageable
memory when pinning fails. `RecordingPinner` stands in for CUDA's cudaHostRegister (no GPU
here); the GPU tests (test_rt_park_gpu.py) run the real one."""
from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from gpuswap.protocol.env import PINNED_KEEP_S
from gpuswap.runtime import parking, pinned

MiB = 1 << 20


class RecordingPinner:
    """Stands in for cudaHostRegister/cudaHostUnregister: records who pinned what, from which
    thread; refuses slabs larger than `limit` the way a pinned-memory limit would."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.pinned: dict[int, int] = {}
        self.unpinned: list[int] = []
        self.threads: set[int] = set()
        self.lock = threading.Lock()

    def pin(self, ptr, nbytes, device):
        with self.lock:
            self.threads.add(threading.get_ident())
            if self.limit is not None and nbytes > self.limit:
                return f"cudaHostRegister of {nbytes} bytes failed (cudaError 2)"
            self.pinned[ptr] = nbytes
        return None

    def unpin(self, ptr, device):
        with self.lock:
            self.threads.add(threading.get_ident())
            assert ptr in self.pinned and ptr not in self.unpinned
            self.unpinned.append(ptr)


class ResidencyPinner(RecordingPinner):
    """Also records, at each pin, how many of the range's pages were not yet in memory (mincore):
    the real cudaHostRegister faults such pages in itself, one thread at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[int] = []
        self.libc = ctypes.CDLL(None, use_errno=True)

    def pin(self, ptr, nbytes, device):
        pages = -(-nbytes // pinned.PAGE)
        vec = (ctypes.c_ubyte * pages)()
        assert self.libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) == 0, ctypes.get_errno()
        with self.lock:
            self.missing.append(sum(1 for v in vec if not v & 1))
        return super().pin(ptr, nbytes, device)


def test_new_slabs_are_faulted_in_before_they_are_pinned():
    pinner = ResidencyPinner()
    pool = pinned.HostPool(pinner, keep_s=3600, slab_bytes=4 * MiB)
    lease = pool.take([5 * MiB, 3 * MiB, 3 * MiB])
    assert len(dict(lease.buffers())) == 3 and len(pinner.missing) == 3
    assert pinner.missing == [0, 0, 0]
    pool.give_back(lease)


def _ptrs(lease):
    return {i: buf.data_ptr() for i, buf in lease.buffers()}


def test_layout_is_exact_aligned_and_capped():
    sizes = [100, 5000, 3 * MiB, 7]
    plan = pinned.layout(sizes, [])
    assert len(plan.new_sizes) == 1
    aligned = sum(-(-n // pinned.ALIGN) * pinned.ALIGN for n in sizes)
    assert plan.new_sizes[0] == -(-aligned // pinned.PAGE) * pinned.PAGE  # exact: no power of two
    spans = sorted((off, off + sizes[i]) for i, (_, off) in enumerate(plan.spots))
    assert all(off % pinned.ALIGN == 0 for off, _ in spans)
    assert all(a_end <= b_off for (_, a_end), (b_off, _) in zip(spans, spans[1:]))  # no overlap
    # slabs of at most slab_bytes, a larger storage alone in one of its own
    capped = pinned.layout([6 * MiB, MiB, MiB, MiB], [], slab_bytes=2 * MiB)
    assert capped.new_sizes == [6 * MiB, 2 * MiB, MiB]
    assert sum(capped.new_sizes) == 9 * MiB


def test_buffers_are_exact_storages_carved_from_one_slab():
    pool = pinned.HostPool(RecordingPinner(), keep_s=3600)
    sizes = [3 * MiB, 4096, 100]
    lease = pool.take(sizes)
    bufs = dict(lease.buffers())
    assert [bufs[i].numel() for i in range(3)] == sizes
    for i, b in bufs.items():
        assert b.untyped_storage().nbytes() == sizes[i]  # torch.save writes only these bytes
        b.fill_(i + 1)
    assert [int(bufs[i][0]) for i in range(3)] == [1, 2, 3]  # nothing overlaps
    assert pool.stats().slabs_made == 1 and lease.pinned and lease.host_bytes <= 1.25 * sum(sizes)
    pool.give_back(lease)


def test_a_second_park_reuses_the_slabs_and_the_idle_pool_is_released_in_the_background():
    pinner = RecordingPinner()
    pool = pinned.HostPool(pinner, keep_s=3600)
    sizes = [2 * MiB, MiB, 512]
    first = pool.take(sizes)
    where = _ptrs(first)
    pool.give_back(first)
    second = pool.take(list(sizes))
    assert _ptrs(second) == where                       # the same host memory, no new pin
    assert pool.stats().slabs_made == 1 and len(pinner.pinned) == 1
    pool.give_back(second)
    # idle for an hour (keep_s): nothing is unpinned until then ...
    assert pool.stats().idle_bytes == second.host_bytes and pinner.unpinned == []
    pool.release_idle()                                 # ... or until asked
    assert pool.wait_released(timeout=60)
    assert pinner.unpinned == list(pinner.pinned)
    assert threading.get_ident() not in pinner.threads  # pinning and unpinning: never this thread
    assert pool.stats() == pinned.PoolStats(slabs_made=1, slabs_released=1)


def test_keep_zero_releases_after_the_park_and_a_leased_slab_is_never_released():
    pinner = RecordingPinner()
    pool = pinned.HostPool(pinner, keep_s=0)
    lease = pool.take([MiB])
    (_, buf), = lease.buffers()
    pool.release_idle()
    assert pool.wait_released(timeout=60)
    assert pinner.unpinned == [] and pool.stats().leased_bytes == lease.host_bytes
    buf.fill_(7)                                        # still mapped, still ours
    pool.give_back(lease)
    assert pool.wait_released(timeout=60)
    assert pinner.unpinned == list(pinner.pinned)


def test_a_slab_far_larger_than_the_park_is_not_reused():
    pinner = RecordingPinner()
    pool = pinned.HostPool(pinner, keep_s=3600)
    big = pool.take([8 * MiB])
    (_, buf), = big.buffers()
    pool.give_back(big)
    small = pool.take([MiB])                            # 8x the bytes: above MAX_OVERHEAD
    assert small.host_bytes == MiB and pool.stats().slabs_made == 2
    assert pool.wait_released(timeout=60)               # the unneeded slab goes at once
    assert pinner.unpinned == [buf.data_ptr()] and pool.stats().leased_bytes == MiB
    pool.give_back(small)
    pool.release_idle()
    assert pool.wait_released(timeout=60)
    assert sorted(pinner.unpinned) == sorted(pinner.pinned)


def test_new_slabs_for_what_does_not_fit_the_old_ones():
    pool = pinned.HostPool(RecordingPinner(), keep_s=3600, slab_bytes=4 * MiB)
    first = pool.take([4 * MiB])
    old = _ptrs(first)[0]
    pool.give_back(first)
    grown = pool.take([4 * MiB, 2 * MiB])               # the model grew: one more slab
    ptrs = _ptrs(grown)
    assert old in ptrs.values() and pool.stats().slabs_made == 2
    assert grown.host_bytes == 6 * MiB
    pool.give_back(grown)


def test_pinning_refused_falls_back_to_pageable_memory_and_the_park_still_restores():
    pinner = RecordingPinner(limit=MiB)                  # slabs above 1 MiB cannot be pinned
    pool = pinned.HostPool(pinner, keep_s=0, slab_bytes=2 * MiB)
    big, small = torch.randn(1 << 20), torch.randn(1000)  # 4 MiB slab refused, 4 KiB pinned
    ref = [big.clone(), small.clone()]
    park = parking.copy_to_host([big, small], simulated=True, pool=pool)
    assert not park.pinned and "cudaError 2" in " ".join(park.lease.notes)
    parking.release(park, simulated=True)
    assert big.untyped_storage().nbytes() == 0 and small.untyped_storage().nbytes() == 0
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert torch.equal(big, ref[0]) and torch.equal(small, ref[1])
    assert pool.wait_released(timeout=60)
    assert pinner.unpinned == list(pinner.pinned) and len(pinner.pinned) == 1  # only the small one


def test_park_host_bytes_within_a_quarter_of_the_parked_bytes_and_reused():
    pool = pinned.HostPool(RecordingPinner(), keep_s=3600, slab_bytes=16 * MiB)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)])  # ~12.6 MB, 24 storages
    tensors = list(model.parameters())
    ref = [t.detach().clone() for t in tensors]
    for round_ in range(2):
        park = parking.copy_to_host(tensors, simulated=True, pool=pool)
        assert park.lease.host_bytes <= 1.25 * park.nbytes
        parking.release(park, simulated=True)
        parking.restore(park, simulated=True)
        parking.drop_host(park)
    assert pool.stats().slabs_made == 1                 # the second park reused the first's slab
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref))
    pool.release_idle()
    assert pool.wait_released(timeout=60)


@pytest.mark.parametrize("raw, want", [(None, 30.0), ("0", 0.0), ("12.5", 12.5), ("-3", 0.0),
                                       ("1e9", 3600.0), ("nan", 30.0), ("soon", 30.0)])
def test_keep_seconds_from_the_environment(raw, want):
    env = {} if raw is None else {PINNED_KEEP_S: raw}
    assert pinned.keep_seconds(env) == want
