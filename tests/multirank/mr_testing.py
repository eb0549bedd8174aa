"""Helpers of the multi-rank tests under a real daemon: the torchrun command of mr_job.py, its
reference run outside gpuswap, bitwise comparison, and whether a process is still alive."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from gpuswap_testing import reference_env  # noqa: E402

JOB = Path(__file__).with_name("mr_job.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def torchrun(nproc: int, *args: str) -> list[str]:
    # `--standalone` binds its rendezvous store to port 0: parallel runs never share a port.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(JOB), *args]


_STARTED: dict[Path, tuple[tuple[Any, ...], Future]] = {}
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mr-reference")


def start_reference(out: Path, nproc: int, steps: int, modes: str = "ddp", *extra: str) -> None:
    """Start `reference(out, ...)` now, on a thread, while the test drives its job (it shares
    nothing with it: its own directory, no daemon); `reference` with the same arguments later
    waits for it instead of starting another. Its torchrun (nproc + 1 processes importing torch)
    took 8-12 s of a test's wall time after the job had ended. Started once the job has attached,
    not beside its start-up (the attach grace), and only in tests whose pause timeout is the
    default 60 s: it adds CPU load while the test pauses and resumes the job."""
    assert out not in _STARTED, out
    _STARTED[out] = ((nproc, steps, modes, extra), _POOL.submit(_reference, out, nproc, steps, modes, *extra))


def reference(out: Path, nproc: int, steps: int, modes: str = "ddp", *extra: str) -> None:
    """The same training under plain torchrun, outside gpuswap (the two lines are no-ops there);
    the run `start_reference` started for `out`, if any, once it has ended."""
    started = _STARTED.pop(out, None)
    if started is None:
        return _reference(out, nproc, steps, modes, *extra)
    args, run = started
    assert args == (nproc, steps, modes, extra), (args, (nproc, steps, modes, extra))
    return run.result()


def _reference(out: Path, nproc: int, steps: int, modes: str = "ddp", *extra: str) -> None:
    env = reference_env(simulated=True)
    env["PYTHONPATH"] = f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    res = subprocess.run(torchrun(nproc, "--steps", str(steps), "--out", str(out), "--modes", modes, *extra), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:]


def load(out: Path, rank: int) -> dict:
    return torch.load(out / f"rank{rank}.pt", weights_only=False)


def completes_bitwise(d: Any, job: int, gate: Any, ref: Path, out: Path, steps: int, nproc: int = 2) -> None:
    """Let the job (held at `gate`) finish: it must end COMPLETED with every rank's parameters,
    optimizer state, RNG and data order bitwise those of the same run outside gpuswap."""
    gate.open()
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", json.dumps(done["events"], indent=1)
    reference(ref, nproc, steps)
    for rank in range(nproc):
        a, b = load(ref / "ddp", rank), load(out / "ddp", rank)
        for key in ("params", "optimizer", "rng", "data"):
            assert_bitwise(a[key], b[key], f"rank {rank} {key}")


def assert_bitwise(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)), where
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


def alive(pid: int) -> bool:
    """Running or stopped (a zombie is dead: it holds no memory and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rindex(b")") + 2:].split()[1])
