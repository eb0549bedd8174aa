"""Host buffers prepared when a pause is asked (runtime/prefault.py): the park takes the prepared
lease, a park whose storages changed meanwhile still parks exactly (reusing what was prepared),
and a withdrawn pause gives it back. Pool-level tests use `RecordingPinner` (no GPU here); the
job-level ones run the simulated GPU's pageable pool."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import gpuswap
from gpuswap.runtime import parking, pinned, prefault
from gpuswap_rt_peer import pause_in_background
from test_rt_host_pool import RecordingPinner

MiB = 1 << 20


def _until(fact, timeout=60.0):
    """Wait for a fact another thread makes true (polled; never a fixed sleep)."""
    end = time.monotonic() + timeout
    while not fact():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def _sizes(tensors):
    return [t.untyped_storage().nbytes() for t in tensors]


def test_the_park_takes_the_prepared_lease_pinned_off_this_thread():
    pinner = RecordingPinner()
    pool = pinned.HostPool(pinner, keep_s=3600, slab_bytes=4 * MiB)
    tensors = [torch.randn(MiB // 4), torch.randn(3 * MiB // 4), torch.randn(100)]
    ref = [t.clone() for t in tensors]
    assert prefault.prepare(pool, prefault.Expected(tuple(_sizes(tensors)), None))
    prepared = prefault.pending(pool)
    assert not prefault.prepare(pool, prefault.Expected((MiB,), None))   # one at a time
    prepared.settled()                                  # the pins are done before the park
    made = pool.stats().slabs_made
    park = parking.copy_to_host(tensors, simulated=True, pool=pool)
    assert park.lease is prepared and pool.stats().slabs_made == made   # nothing new at the park
    assert prefault.stats(pool) == prefault.PrefaultStats(prepared=1, used=1)
    assert threading.get_ident() not in pinner.threads and park.pinned
    parking.release(park, simulated=True)
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref))
    assert prefault.pending(pool) is None
    pool.release_idle()
    assert pool.wait_released(timeout=60)
    assert sorted(pinner.unpinned) == sorted(pinner.pinned)


@pytest.mark.parametrize("change", ["grown", "shrunk", "reordered"])
def test_storages_changed_since_the_request_still_park_exactly(change):
    pool = pinned.HostPool(RecordingPinner(), keep_s=3600, slab_bytes=4 * MiB)
    torch.manual_seed(0)
    tensors = [torch.randn(n) for n in (MiB // 2, 3 * MiB // 4, MiB // 8, 1000)]
    expected = _sizes(tensors)
    if change == "grown":           # e.g. the optimizer's state appeared in the step
        tensors += [torch.randn(MiB // 2), torch.randn(2 * MiB)]
    elif change == "shrunk":
        tensors = tensors[1:]
    else:
        tensors = tensors[::-1]
    ref = [t.clone() for t in tensors]
    prefault.prepare(pool, prefault.Expected(tuple(expected), None))
    prepared_slabs = {s.ptr for s in prefault.pending(pool).settled()}
    park = parking.copy_to_host(tensors, simulated=True, pool=pool)
    assert prefault.stats(pool).redone == 1
    assert park.lease.host_bytes <= pinned.MAX_OVERHEAD * park.nbytes   # the park's own bytes
    if change != "shrunk":          # what was prepared is reused, not pinned anew
        assert prepared_slabs <= {s.ptr for s in park.lease.settled()}
    parking.release(park, simulated=True)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    parking.restore(park, simulated=True)
    parking.drop_host(park)
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref))            # bitwise
    pool.release_idle()
    assert pool.wait_released(timeout=60)


def test_a_withdrawn_preparation_goes_back_to_the_pool_and_is_released():
    pinner = RecordingPinner()
    pool = pinned.HostPool(pinner, keep_s=0)
    prefault.prepare(pool, prefault.Expected((MiB, 2 * MiB), None))
    lease = prefault.pending(pool)
    assert prefault.withdraw(pool) and prefault.pending(pool) is None
    assert not prefault.withdraw(pool)                   # once
    _until(lambda: not pool.holds(lease))                # given back once its pins are done
    _until(lambda: len(pinner.unpinned) == 1)            # keep_s=0: released right away
    assert pool.wait_released(timeout=60)
    assert sorted(pinner.unpinned) == sorted(pinner.pinned) and len(pinner.pinned) == 1
    assert prefault.stats(pool).withdrawn == 1


def test_off_by_environment():
    assert prefault.enabled({}) and prefault.enabled({"GPUSWAP_PREFAULT": "1"})
    assert not prefault.enabled({"GPUSWAP_PREFAULT": "0"})


# -- through the job's handle (simulated GPU) ----------------------------------------------------
def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters())


def _step(model, opt):
    model(torch.randn(4, 64)).sum().backward()
    opt.step()


def test_job_pause_uses_the_prepared_lease_and_a_grown_job_still_parks_bitwise(sim_env):
    pool = pinned.pool_for(True)
    before = prefault.stats(pool)
    model, opt = _model()
    _step(model, opt)
    job = gpuswap.attach(model=model, optimizer=opt)
    sim_env.expect("hello")
    # 1: nothing changed between the request and the safepoint: the park takes the prepared lease
    seen = pause_in_background(job, lambda: {"bytes": job.device_bytes()})
    assert seen == {"bytes": 0}
    sim_env.expect("paused"), sim_env.expect("resumed")
    after = prefault.stats(pool)
    assert (after.prepared - before.prepared, after.used - before.used) == (1, 1)
    # 2: the job grew after its last measurement (a new buffer): exact all the same
    model.register_buffer("extra", torch.randn(5000))
    tensors = list(model.parameters()) + list(model.buffers()) + \
        [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    ref = [t.clone() for t in tensors]
    pause_in_background(job, lambda: {})
    sim_env.expect("paused"), sim_env.expect("resumed")
    assert prefault.stats(pool).redone - after.redone == 1
    assert all(torch.equal(t, r) for t, r in zip(tensors, ref))
    assert prefault.pending(pool) is None
    _step(model, opt)                                   # and training goes on
    job.close()


def test_job_pause_withdrawn_before_the_safepoint_gives_the_lease_back(sim_env):
    pool = pinned.pool_for(True)
    model, opt = _model()
    _step(model, opt)
    job = gpuswap.attach(model=model, optimizer=opt)
    sim_env.expect("hello")
    job.request_pause("ram")
    lease = prefault.pending(pool)
    assert lease is not None and sorted(lease.sizes) == sorted(job._expected.sizes)
    withdrawn = prefault.stats(pool).withdrawn
    job.request_resume()
    assert sim_env.expect("resumed") == {"op": "resumed", "bytes": 0, "seconds": 0.0}
    assert prefault.pending(pool) is None and prefault.stats(pool).withdrawn == withdrawn + 1
    _until(lambda: not pool.holds(lease))                # idle: released after keep_s
    job.safepoint(1)
    assert not job.parked
    # a RAM pause over the job's cap, with no checkpoint directory to go to, prepares nothing
    job.request_pause("ram", max_bytes=1)
    assert prefault.pending(pool) is None
    job.safepoint(2)                                    # fails ("exceed the RAM budget"), runs on
    assert "exceed" in sim_env.expect("error")["message"] and not job.parked
    job.close()
