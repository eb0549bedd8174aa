"""A multi-rank RAM park's riskiest step, proved on CPU with gloo under a real torchrun: destroy
every process group at a common step, park the attached tensors (gpuswap's own parking code,
simulated device), create the default group again with the same ranks on the kept store, rebind
DDP / ZeroRedundancyOptimizer / FSDP2, train on, and end bitwise equal to an uninterrupted run on
every rank (docs/design/multi-rank.md, section 3).

Each case starts torchrun twice (uninterrupted, and with two rebuilds): tens of seconds on a
loaded machine, hence `slow`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

JOB = Path(__file__).with_name("group_rebuild_job.py")
SRC = Path(__file__).resolve().parents[2] / "src"
STEPS = 12
PARK_AT = "3,7"

pytestmark = pytest.mark.slow


def torchrun(out: Path, mode: str, nproc: int, park_at: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("GPUSWAP_JOB_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(JOB), "--mode", mode, "--steps", str(STEPS), "--park-at", park_at, "--out", str(out)]
    # `--standalone` binds its rendezvous store to port 0: parallel runs never share a port.
    # Deadlines only: the ranks' own watchdog (170 s) ends a hang with its stacks, this 180 s
    # bound ends a launcher that outlives them.
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout[-6000:]


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def bits(t: "torch.Tensor") -> "torch.Tensor":
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("mode, nproc", [("ddp", 2), ("ddp", 4), ("zero", 2), ("fsdp2", 2)])
def test_group_rebuilt_twice_ends_bitwise_equal(tmp_path, mode, nproc):
    straight, rebuilt = tmp_path / "straight", tmp_path / "rebuilt"
    torchrun(straight, mode, nproc, "")
    torchrun(rebuilt, mode, nproc, PARK_AT)
    for rank in range(nproc):
        a, b = load(straight, rank), load(rebuilt, rank)
        assert (a["rebuilt"], b["rebuilt"]) == (0, 2)
        assert b["groups"] == 3          # the first group and two new ones, each a distinct object
        assert all(n > 0 for n in b["freed"]), b["freed"]   # the park really released storage
        assert_bitwise(a["params"], b["params"], f"rank {rank} params")
        assert_bitwise(a["optimizer"], b["optimizer"], f"rank {rank} optimizer")
        assert_bitwise(a["rng"], b["rng"], f"rank {rank} rng")
        # not vacuous: training moved every parameter away from its initial value
        assert all(not torch.equal(a["params"][k], a["initial"][k]) for k in a["params"]
                   if a["params"][k].is_floating_point() and k.endswith("weight"))
