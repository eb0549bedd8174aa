import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gpuswap_rt_peer import DEMO_STEPS, SupervisorPeer, finish, read_result, start_train  # noqa: E402
from gpuswap_testing import reference_env  # noqa: E402


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU")
    here = Path(__file__).parent
    for item in items:
        if "gpu" in item.keywords and not has_cuda and here in Path(item.path).parents:
            item.add_marker(skip)


@pytest.fixture
def peer():
    p = SupervisorPeer()
    yield p
    p.close()


@pytest.fixture
def sim_env(monkeypatch, peer):
    """This process is a job on a simulated GPU, its supervisor the test's `peer`: what an
    in-process `gpuswap.attach` needs (no checkpoint directory, preparation of host buffers on)."""
    monkeypatch.setenv("GPUSWAP_JOB_ID", "sim-test")
    monkeypatch.setenv("GPUSWAP_SIMULATED_GPU", "1")
    monkeypatch.setenv("GPUSWAP_CONTROL", peer.address)
    monkeypatch.delenv("GPUSWAP_CKPT_DIR", raising=False)
    monkeypatch.delenv("GPUSWAP_PREFAULT", raising=False)
    return peer


@pytest.fixture(scope="session")
def baseline(tmp_path_factory):
    """The demo run uninterrupted and outside gpuswap: the reference for exact resume. On the CPU,
    as the jobs it is compared with (job_env: GPUSWAP_SIMULATED_GPU=1), even where torch has CUDA."""
    out = tmp_path_factory.mktemp("baseline") / "result.json"
    rc, _, err = finish(start_train(out, DEMO_STEPS, 0.0, env=reference_env(simulated=True)))
    assert rc == 0, err
    result = read_result(out)
    assert result["device"] == "cpu", result
    return result
