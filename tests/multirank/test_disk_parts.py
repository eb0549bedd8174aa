"""A multi-rank disk checkpoint, for real, on CPU with gloo under torchrun: at a common step every
rank writes its part (runtime/rankstate.py, runtime/ckparts.py), rank 0 commits the manifest,
every rank exits; a second torchrun restores every rank from it and trains on; the end is
bitwise equal, rank by rank (parameters, optimizer state, RNG states, data generator, job.state),
to an uninterrupted run (docs/design/multi-rank.md §4, §5).

Each case starts torchrun three times (uninterrupted, up to the checkpoint, from it): tens of
seconds on a loaded machine, hence `slow`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_group_rebuild import SRC, assert_bitwise, load, torch

STEPS = 7
STOP_AT = 3

pytestmark = pytest.mark.slow


def run(out: Path, ckpt: Path, mode: str, nproc: int, stop_at: int = -1) -> None:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("GPUSWAP_JOB_ID", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).with_name("disk_parts_job.py")), "--mode", mode, "--steps", str(STEPS),
           "--stop-at", str(stop_at), "--ckpt", str(ckpt), "--out", str(out)]
    # port 0 rendezvous (`--standalone`); deadlines only, as in test_group_rebuild.py
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=180)
    assert res.returncode == 0, res.stdout[-6000:]


@pytest.mark.parametrize("mode, nproc", [("ddp", 2), ("zero", 2), ("fsdp2", 2), ("ddp", 4)])
def test_disk_restart_ends_bitwise_equal(tmp_path, mode, nproc):
    straight, resumed, ckpt = tmp_path / "straight", tmp_path / "resumed", tmp_path / "ckpt"
    run(straight, tmp_path / "none", mode, nproc)
    run(tmp_path / "unused", ckpt, mode, nproc, stop_at=STOP_AT)
    manifest = json.loads((ckpt / "ckpt-000001.json").read_text())
    assert manifest["world_size"] == nproc and manifest["step"] == STOP_AT
    parts = {p["rank"]: torch.load(ckpt / p["file"], weights_only=False) for p in manifest["parts"]}
    if mode == "ddp":      # the replicated model and optimizer: in rank 0's part, and only there
        assert set(parts[0]["shared"]) == {"model", "optimizer"}
        assert all(parts[r]["shared"] == {} for r in range(1, nproc))
        assert all(not any(k.endswith("weight") for k in parts[r]["own"]["model"]["state"])
                   for r in range(nproc))
    else:                  # shards: every part carries its own optimizer state
        key = "local" if mode == "zero" else None
        for r in range(nproc):
            opt = parts[r]["own"]["optimizer"]["state"]
            assert (opt[key] if key else opt)["state"], f"rank {r} has no optimizer shard"
    assert not (tmp_path / "unused").exists()          # that run ended at the checkpoint
    run(resumed, ckpt, mode, nproc)
    for rank in range(nproc):
        a, b = load(straight, rank), load(resumed, rank)
        assert (a["restored"], b["restored"]) == (None, 1)
        assert b["state"] == a["state"] == {"epoch": 0, "seen": list(range(STEPS))}
        for what in ("params", "optimizer", "rng", "data"):
            assert_bitwise(a[what], b[what], f"rank {rank} {what}")
