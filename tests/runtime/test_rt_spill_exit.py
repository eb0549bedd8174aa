"""A job spilled from RAM to disk leaves with its tensors whole: the spill freed their device
memory at the RAM park, and the unwinding after the checkpoint runs the job's own code (on an
H100, Lightning's teardown failed on a freed tensor: exit 1, not 75). They are pointed at their
host copies (`parking.leave_on_host`), same objects, same views."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.runtime import parking
from gpuswap_rt_peer import finish, job_env

HERE = Path(__file__).parent


def test_freed_tensors_leave_on_the_host_whole_and_still_sharing():
    torch.manual_seed(0)
    base = torch.randn(16)
    left, right = base[:6], base[6:].view(2, 5)      # views of one resizable storage
    foreign = torch.from_numpy(np.arange(12, dtype=np.float32)).view(3, 4)   # not resizable
    param = torch.nn.Parameter(torch.randn(3, 3))
    tensors = [base, left, right, foreign, param]
    ref = [t.detach().clone() for t in tensors]
    park = parking.copy_to_host(tensors, simulated=True)
    parking.release(park, simulated=True)
    assert base.untyped_storage().nbytes() == 0 and foreign.numel() == 0   # freed, as a spill leaves them

    moved = parking.leave_on_host(park, tensors)

    assert moved >= len(tensors)
    for t, r in zip(tensors, ref):
        assert t.device.type == "cpu" and t.shape == r.shape and torch.equal(t, r)
        assert t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()
    assert isinstance(param, torch.nn.Parameter)
    left.fill_(3.0)
    assert bool((base[:6] == 3.0).all())             # views still share their bytes
    right.fill_(4.0)
    assert bool((base[6:] == 4.0).all())
    parking.drop_host(park)


def test_nothing_moves_while_the_device_memory_is_kept():
    t = torch.randn(8)
    park = parking.copy_to_host([t], simulated=True)   # copied, not released (a disk park's copy)
    storage = t.untyped_storage()._cdata
    assert parking.leave_on_host(park, [t]) == 0
    assert t.untyped_storage()._cdata == storage
    parking.drop_host(park)


def _spill(peer, tmp_path, **env):
    """spill_exit_job.py parked in RAM, then spilled: (rc, stderr, out path)."""
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, str(HERE / "spill_exit_job.py"), str(out)],
                            env={**job_env(peer, tmp_path / "ckpt"), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peer.expect("hello")
    peer.send({"op": "pause", "tier": "ram"})
    assert peer.expect("paused")["tier"] == "ram"
    usage = peer.expect("usage")
    assert usage["parked"] is True and usage["device_bytes"] == 0   # freed before the spill
    peer.send({"op": "pause", "tier": "disk"})
    assert peer.expect("checkpointed")["bytes"] > 0
    rc, _, err = finish(proc)
    return rc, err, out


def test_a_spilled_job_unwinds_on_whole_tensors_and_exits_75(peer, tmp_path):
    rc, err, out = _spill(peer, tmp_path)
    assert rc == REQUEUE_EXIT_CODE, err
    seen = json.loads(out.read_text())
    assert seen["whole"] and seen["leaving"] == seen["before"] and seen["shared"], seen


def test_without_leave_on_host_the_simulated_gpu_fails_the_exit_as_the_h100_did(peer, tmp_path):
    """Mutation check: with leave_on_host a no-op the unwinding's `.to("cpu")` reads a freed tensor.
    On an H100 that was "CUDA error: invalid argument" and exit 1; the simulated GPU, which let it
    pass (exit 75) before runtime/freedguard.py, now fails the same way."""
    rc, err, out = _spill(peer, tmp_path, SPILL_EXIT_KEEP_FREED="1")
    assert rc == 1, (err, out.exists() and out.read_text())
    assert "RuntimeError: CUDA error: invalid argument" in err and 't.to("cpu")' in err, err[-3000:]
    assert not out.exists()
