"""On a real GPU (skipped without one): the daemon parks a CUDA training job, NVML shows its memory
released while parked, and it resumes bitwise-exactly; an unmodified job is frozen by the driver."""
from __future__ import annotations

import json

import pytest

from gpuswap_testing import Gate, train_cmd

pytestmark = pytest.mark.gpu


def _used_by(pid_tree_root: int) -> int:
    import psutil
    import pynvml

    pynvml.nvmlInit()
    tree = {pid_tree_root} | {p.pid for p in psutil.Process(pid_tree_root).children(recursive=True)}
    total = 0
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        total += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid in tree)
    return total


def _job_pid(home, job_id: int, generation: int = 1) -> int:
    return json.loads((home / "jobs" / str(job_id) / f"run-{generation}" / "status.json").read_text())["job_pid"]


def test_cuda_job_parked_in_ram_releases_memory_and_resumes_exactly(make_daemon, home, reference_hashes):
    import pynvml

    pynvml.nvmlInit()
    n = pynvml.nvmlDeviceGetCount()
    d = make_daemon("--min-runtime", "1")
    steps, hidden = 300, 4096
    long_id = d.submit(train_cmd(home / "long.json", steps, 0.01, hidden), name="long", priority="low", gpus=n)
    d.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) > 10, timeout=120)
    pid = _job_pid(home, long_id)
    before = _used_by(pid)
    gate = Gate(home / "urgent.go")      # the urgent job holds the GPU until NVML has been read
    urgent = d.submit(gate.hold(), name="urgent", priority="urgent")
    d.until(long_id, lambda j: j["state"] == "PAUSED", timeout=120)
    during = _used_by(pid)
    gate.open()
    assert d.cli("wait", str(urgent)).returncode == 0
    d.state(long_id, "COMPLETED", timeout=300)
    print(f"NVML: {before / 2**20:.0f} MiB before park, {during / 2**20:.0f} MiB while parked")
    assert during < before / 4     # tensors and the caching allocator's memory are gone; the context stays
    assert json.loads((home / "long.json").read_text())["sha256"] == reference_hashes(steps, hidden)
