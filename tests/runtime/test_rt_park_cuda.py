"""The real CUDA path: pinned copies, freed device memory, CUDA RNG. Needs an NVIDIA GPU."""
from __future__ import annotations

import pytest
import torch

from gpuswap.runtime import parking, rng

pytestmark = pytest.mark.gpu


def test_cuda_park_releases_reserved_memory_and_restores_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096).cuda()  # 64 MiB of weights
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    tensors = list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values()]
    before = [(t, t.clone()) for t in tensors]
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    park = parking.copy_to_host(tensors, simulated=False)
    assert all(s.host.is_pinned() for s in park.slots.values())
    parking.release(park, simulated=False)
    assert parking.device_bytes(tensors, simulated=False) == 0
    assert torch.cuda.memory_reserved() < reserved - park.nbytes // 2
    parking.restore(park, simulated=False)
    parking.drop_host(park)
    for t, ref in before:   # Adam keeps its step count on the CPU (capturable=False): it stays there
        assert t.device == ref.device and torch.equal(t, ref)
    assert model.weight.is_cuda and opt.state[model.weight]["exp_avg"].is_cuda
    assert opt.param_groups[0]["params"][0] is model.weight


def test_cuda_rng_round_trip():
    torch.cuda.init()
    torch.cuda.manual_seed_all(5)
    state = rng.capture()
    want = torch.rand(4, device="cuda")
    torch.rand(100, device="cuda")
    assert rng.restore(state) == []
    assert torch.equal(torch.rand(4, device="cuda"), want)
