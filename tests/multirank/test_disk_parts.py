"""A multi-rank disk checkpoint, for real, on CPU with gloo under torchrun: at a common step every
rank writes its part (runtime/rankstate.py, runtime/ckparts.py) and rank 0 commits the manifest;
a second torchrun restores every rank from it and trains on; the end is bitwise equal, rank by
rank (parameters, optimizer state, RNG states, data generator, job.state), to the uninterrupted
run (docs/design/multi-rank.md §4, §5). DDP, DDP + ZeroRedundancyOptimizer and FSDP2 with 2
ranks; DDP with 4 ranks, where the bucket layout after a restart matters (runtime/ddpbuckets.py).

Cost: starting torchrun is most of it, so one launch runs every mode, and the uninterrupted
reference run writes the checkpoint on its way (writing must not disturb it; that is checked
too). Two launches per world size, hence `slow`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mr_testing import SRC, assert_bitwise, load, torch

STEPS = 7
CKPT_AT = 3

pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("GPUSWAP_JOB_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).with_name("disk_parts_job.py")), "--steps", str(STEPS), *args]
    # port 0 rendezvous (`--standalone`); deadlines only: the ranks' watchdog (170 s) ends a hang
    # with its stacks, this bound a launcher that outlives them
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout[-6000:]


def check_parts(ckpt: Path, mode: str, nproc: int) -> None:
    manifest = json.loads((ckpt / "ckpt-000001.json").read_text())
    assert manifest["world_size"] == nproc and manifest["step"] == CKPT_AT
    parts = {p["rank"]: torch.load(ckpt / p["file"], weights_only=False) for p in manifest["parts"]}
    if mode == "ddp":      # the replicated model and optimizer: in rank 0's part, and only there
        assert set(parts[0]["shared"]) == {"model", "optimizer"}
        assert all(parts[r]["shared"] == {} for r in range(1, nproc))
        assert all(not any(k.endswith("weight") for k in parts[r]["own"]["model"]["state"])
                   for r in range(nproc))
    else:                  # shards: every part carries its own optimizer state
        for r in range(nproc):
            opt = parts[r]["own"]["optimizer"]["state"]
            assert (opt["local"] if mode == "zero" else opt)["state"], f"rank {r} has no optimizer shard"
    if mode != "fsdp2":    # the rebuilt DDP buckets (two, by this model's bucket cap) are recorded
        assert all(len(parts[r]["ddp_buckets"][0]) == 2 for r in range(nproc))


@pytest.mark.parametrize("nproc, modes", [(2, ("ddp", "zero", "fsdp2")), (4, ("ddp",))])
def test_disk_restart_ends_bitwise_equal(tmp_path, nproc, modes):
    straight, resumed, ckpt = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ckpt"
    common = ("--modes", ",".join(modes), "--ckpt", str(ckpt))
    torchrun(nproc, *common, "--out", str(straight), "--ckpt-at", str(CKPT_AT), "--go-on")
    torchrun(nproc, *common, "--out", str(resumed))
    for mode in modes:
        check_parts(ckpt / mode, mode, nproc)
        for rank in range(nproc):
            a, b = load(straight / mode, rank), load(resumed / mode, rank)
            assert (a["restored"], b["restored"]) == (None, 1)
            assert b["state"] == a["state"] == {"epoch": 0, "seen": list(range(STEPS))}
            for what in ("params", "optimizer", "rng", "data"):
                assert_bitwise(a[what], b[what], f"{mode} rank {rank} {what}")
