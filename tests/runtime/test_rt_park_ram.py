"""Parking to RAM in-process under a simulated GPU: memory really goes, the same tensor objects
come back bitwise, and the control channel hears about it."""
from __future__ import annotations

import numpy as np
import torch

import gpuswap
from gpuswap_rt_peer import pause_in_background


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied weights share one Parameter
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_park_frees_and_restores_same_tensors_bitwise(sim_env):
    model, opt = _trained()
    base = torch.randn(10)
    left, right = base[:5], base[5:]  # two views of one storage
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()] + list(model.buffers())
    tensors += [v for st in opt.state.values() for v in st.values()]
    before = [(t, t.clone()) for t in tensors + [left, right]]
    storages = [t.untyped_storage()._cdata for t in tensors]
    job = gpuswap.attach(model=model, optimizer=opt, left=left, right=right)
    assert sim_env.expect("hello")["device_bytes"] > 0
    full = job.device_bytes()

    seen = pause_in_background(job, lambda: {
        "bytes": job.device_bytes(),
        "storage_sizes": {t.untyped_storage().nbytes() for t, _ in before},
    })
    assert seen == {"bytes": 0, "storage_sizes": {0}}  # everything attached was released
    paused = sim_env.expect("paused")
    assert paused["bytes"] == full and paused["step"] == 7
    assert sim_env.expect("resumed")["bytes"] == full
    assert not job.parked and job.device_bytes() == full
    for t, ref in before:
        assert torch.equal(t, ref)
    assert [t.untyped_storage()._cdata for t in tensors] == storages  # same storage objects
    assert opt.param_groups[0]["params"][0] is model[0].weight is model[2].weight
    left.fill_(1.0)
    assert torch.equal(base[:5], torch.ones(5))  # views still share their storage
    model(torch.randn(4, 8)).sum().backward()  # and training goes on
    opt.step()
    job.close()


def test_tensor_on_foreign_memory_is_parked_through_a_placeholder(sim_env):
    array = np.arange(12, dtype=np.float32)
    t = torch.from_numpy(array).view(3, 4)  # storage torch cannot resize
    job = gpuswap.attach(t=t)
    seen = pause_in_background(job, lambda: {"numel": t.numel()})
    assert seen == {"numel": 0}
    assert torch.equal(t, torch.arange(12, dtype=torch.float32).view(3, 4)) and t.shape == (3, 4)
    job.close()


def test_pause_ignored_when_parked_and_cancelled_by_early_resume(sim_env):
    model, opt = _trained()
    job = gpuswap.attach(model=model, optimizer=opt)
    sim_env.expect("hello")
    job.request_pause("ram")
    job.request_resume()  # before any safepoint: the pause is withdrawn
    assert sim_env.expect("resumed") == {"op": "resumed", "bytes": 0, "seconds": 0.0}
    job.safepoint(1)  # returns at once
    assert not job.parked

    def check():
        job.request_pause("ram")  # already parked: ignored
        return {"parked": job.parked}

    assert pause_in_background(job, check) == {"parked": True}
    sim_env.expect("paused")
    sim_env.expect("resumed")
    job.close()
