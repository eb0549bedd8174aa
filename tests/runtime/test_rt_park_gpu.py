"""The runtime's GPU path on a real GPU, each scenario in a fresh process (gpu_park_child.py) so
that NVML's per-process figures and the RSS are its own:

- a park releases the process's GPU memory down to its floor: the CUDA context with cuBLAS and
  the step's kernels loaded, nothing allocated, measured by NVML in the same process first;
  cuBLAS workspaces included (the allocator holds nothing while parked);
- host RAM grows by at most 1.25x the parked bytes (RSS), from exact-size pinned buffers; the
  next park reuses them (same host addresses, no new slab), the resume returns before anything
  is unpinned, and the pool's release frees them;
- what is promised stays put: the same tensor and storage objects, bitwise equal;
- only the GPU the tensors live on has a context (needs two GPUs);
- a CUDA graph makes a RAM park refused with the reason, or a disk park that says why;
- wrapper subclasses (TwoTensor) on CUDA are parked through their inner tensors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

CHILD = Path(__file__).parent / "gpu_park_child.py"
MiB = 1 << 20
FLOOR_SLACK = 64 * MiB   # kernels first loaded by the big step's GEMMs (lazy module loading)


def run(scenario: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    env["GPUSWAP_PINNED_KEEP_S"] = "600"   # the test releases the pool itself
    proc = subprocess.run([sys.executable, str(CHILD), scenario], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_park_releases_to_the_context_floor_within_a_quarter_more_host_ram():
    r = run("floor")
    if not r["floor"]:
        pytest.skip("NVML does not list this process (a PID namespace?): per-process memory unknown")
    assert r["reserved_at_floor"] == 0, r
    first, second = r["parks"]
    parked = first["nbytes"]
    assert parked > 1900 * MiB and r["held"] >= r["floor"] + parked, r
    for p in (first, second):
        assert p["nvml"] <= r["floor"] + FLOOR_SLACK, r      # down to the measured floor
        assert p["reserved"] == 0 and p["allocated"] == 0, r  # cuBLAS workspaces gone too
        assert p["device_bytes"] == 0 and p["nbytes"] == parked
        assert p["pinned"] and p["host_pinned"], r
        assert p["host_bytes"] <= 1.25 * parked, r           # no power-of-two blocks
        assert p["rss_growth"] <= 1.25 * parked, r
        assert p["pinned_after_resume"] > 0, r               # resume returned before any unpin
    assert second["host_ptrs"] == first["host_ptrs"], r      # the pool served the second park
    assert second["slabs_made"] == first["slabs_made"], r
    assert second["rss_growth"] <= 0.05 * parked, r          # no fresh pin, no new host RAM
    assert r["bitwise"] and r["same_storages"] and r["same_params"], r
    assert r["released"] and r["pinned_after_release"] == 0, r
    assert r["rss_freed_by_release"] >= 0.9 * parked, r


def test_only_the_parked_gpu_gets_a_context():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two visible GPUs")
    r = run("devices")
    if r["before"] != [r["uuid1"]]:
        pytest.skip(f"before any park the process is on {r['before']}, not only on cuda:1 "
                    "(torch itself, or NVML cannot see this process)")
    assert r["parked"] == [r["uuid1"]] and r["after"] == [r["uuid1"]], r
    assert r["bitwise"], r


def test_a_cuda_graph_refuses_the_ram_park_or_parks_to_disk_saying_why():
    r = run("graph")
    assert "CUDA graph" in r["direct"] and r["disk_ok"] is True, r
    (err,) = r["no_ckpt_msgs"]
    assert err["op"] == "error" and "park to ram failed: ParkRefused" in err["message"], r
    assert "CUDA graph" in err["message"] and not r["no_ckpt_parked"], r
    assert r["replay_ok"] and r["ptrs_kept"], r                 # the job runs on, graph intact
    assert r["exit"] == 75, r
    (ck,) = [m for m in r["ckpt_msgs"] if m["op"] == "checkpointed"]
    assert "RAM park refused" in ck["note"] and "CUDA graph" in ck["note"] and ck["bytes"] > 0, r
    assert r["ckpt_ptrs_kept"] and r["ckpt_allocated_kept"], r  # nothing moved before the exit


def test_wrapper_subclasses_on_cuda_park_through_their_inner_tensors():
    r = run("wrappers")
    assert r["wrapped"] == r["tensors"] and r["wrapped"] > 0, r
    assert r["device_bytes"] == r["inner_bytes"] == r["paused_bytes"] > 0, r
    assert r["allocated"] == 0 and r["inner_sizes"] == [0], r
    assert r["msgs"] == ["paused", "resumed"], r
    assert r["bitwise"] and r["same_inner"], r
