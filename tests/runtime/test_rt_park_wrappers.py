"""Wrapper tensor subclasses (TwoTensor, FSDP2's DTensor) are parked through their inner tensors
and come back bitwise in the same objects; a tensor whose memory cannot be reached makes a RAM
park refused with the reason while the job trains on; a RAM pause turned into a disk park says
why in its `checkpointed` message. Simulated GPU: CPU tensors stand for device memory."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from gpuswap_rt_peer import finish, job_env, start_train
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map

import gpuswap
from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.runtime import parking


@pytest.fixture
def sim_env(monkeypatch, peer):
    monkeypatch.setenv("GPUSWAP_JOB_ID", "wrap-test")
    monkeypatch.setenv("GPUSWAP_SIMULATED_GPU", "1")
    monkeypatch.setenv("GPUSWAP_CONTROL", peer.address)
    monkeypatch.delenv("GPUSWAP_CKPT_DIR", raising=False)
    return peer


def _park_once(job, check):
    """Ask for a RAM pause, enter the safepoint; `check` runs in another thread while parked."""
    seen = {}

    def drive():
        while not job.parked:
            time.sleep(0.001)
        seen.update(check())
        job.request_resume()

    job.request_pause("ram")
    t = threading.Thread(target=drive)
    t.start()
    job.safepoint(3)
    t.join(60)
    return seen


def _leaves(t):
    return [t.a, t.b] if isinstance(t, TwoTensor) else [t]


def _two_tensor_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    for layer in model:
        for name in ("weight", "bias"):
            w = getattr(layer, name).detach()
            setattr(layer, name, torch.nn.Parameter(TwoTensor(w.clone(), w.clone() * 2)))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def test_two_tensor_wrappers_park_through_their_inner_tensors(sim_env):
    model, opt = _two_tensor_training()
    wrapped = list(model.parameters()) + [p.grad for p in model.parameters()]
    wrapped += [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert all(isinstance(t, TwoTensor) for t in wrapped)
    inner = [x for t in wrapped for x in _leaves(t)]
    before = [(x, x.clone()) for x in inner]
    steps = [st["step"] for st in opt.state.values()]
    expect = {x.untyped_storage()._cdata: x.untyped_storage().nbytes() for x in inner + steps}
    job = gpuswap.attach(model=model, optimizer=opt)
    hello = sim_env.expect("hello")
    assert hello["device_bytes"] == sum(expect.values())   # the inner storages, each once

    seen = _park_once(job, lambda: {"sizes": {x.untyped_storage().nbytes() for x in inner},
                                    "bytes": job.device_bytes()})
    assert seen == {"sizes": {0}, "bytes": 0}
    assert sim_env.expect("paused")["bytes"] == sum(expect.values())
    sim_env.expect("resumed")
    for x, ref in before:
        assert torch.equal(x, ref)                          # bitwise, in the same inner objects
    assert [x for t in wrapped for x in _leaves(t)] == inner
    assert opt.param_groups[0]["params"][0] is model[0].weight
    model(torch.randn(3, 8)).sum().backward()               # and training goes on
    opt.step()
    job.close()


def test_a_wrapper_host_view_is_rebuilt_around_the_host_copies():
    model, _ = _two_tensor_training()
    w = model[0].weight
    park = parking.copy_to_host([w], simulated=True)
    try:
        view = park.host_view(w.detach())
        assert isinstance(view, TwoTensor) and torch.equal(view.a, w.a) and torch.equal(view.b, w.b)
        hosts = {s.host.data_ptr() for s in park.slots.values()}
        assert {view.a.data_ptr(), view.b.data_ptr()} == hosts  # views of the copies, no third copy
    finally:
        parking.drop_host(park)


class Opaque(torch.Tensor):
    """A wrapper subclass without __tensor_flatten__: its memory is out of the runtime's reach."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.elem if isinstance(x, Opaque) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_a_tensor_the_runtime_cannot_unwrap_refuses_the_ram_park_with_the_reason(sim_env):
    model = torch.nn.Linear(4, 4)
    opaque = Opaque(torch.arange(64, dtype=torch.float32))
    job = gpuswap.attach(model=model, opaque=opaque)        # measuring it does not crash
    hello = sim_env.expect("hello")
    assert hello["device_bytes"] == 64 * 4 + sum(p.numel() * 4 for p in model.parameters())
    weight = model.weight.detach().clone()
    job.request_pause("ram")
    job.safepoint(1)                                        # refused: returns, the job runs on
    err = sim_env.expect("error")["message"]
    assert err.startswith("park to ram failed: ParkRefused: cannot reach the device memory of a Opaque")
    assert "__tensor_flatten__" in err
    assert not job.parked and model.weight.untyped_storage().nbytes() > 0  # nothing half parked
    assert torch.equal(model.weight, weight) and torch.equal(opaque.elem, torch.arange(64.0))
    job.close()


def test_fsdp2_dtensor_parameters_park_and_restore(sim_env):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        local = [p._local_tensor for p in params] + [v._local_tensor for st in opt.state.values()
                                                    for k, v in st.items() if k != "step"]
        before = [(x, x.clone()) for x in local]
        job = gpuswap.attach(model=model, optimizer=opt)
        assert sim_env.expect("hello")["device_bytes"] > 0
        seen = _park_once(job, lambda: {"sizes": {x.untyped_storage().nbytes() for x in local}})
        assert seen == {"sizes": {0}}
        sim_env.expect("paused")
        sim_env.expect("resumed")
        for x, ref in before:
            assert torch.equal(x, ref)
        assert [p._local_tensor for p in model.parameters()] == local[:len(params)]
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        job.close()
    finally:
        dist.destroy_process_group()


def test_a_ram_pause_over_the_budget_parks_to_disk_and_says_why(peer, tmp_path):
    out, gate = tmp_path / "result.json", tmp_path / "go"
    proc = start_train(out, 100, 0.02, job_env(peer, tmp_path / "ckpt"), gate)
    peer.expect("hello")
    peer.send({"op": "pause", "tier": "ram", "max_bytes": 1})
    ck = peer.expect("checkpointed")
    assert "exceed the host-RAM budget's 1" in ck["note"] and ck["bytes"] > 0
    rc, _, err = finish(proc)
    assert rc == REQUEUE_EXIT_CODE, err
    assert "parking to disk instead" in err
