"""The on-disk checkpoint format: round trip, checksums, fallback, crash safety."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from gpuswap import fsutil
from gpuswap.runtime import checkpoint, rng
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.handle import Job
from gpuswap.runtime.objects import classify
from gpuswap.runtime.pausing import restore_latest, snapshot


def _training_objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(seed)
    return model, opt, sched, gen


def _train(model, opt, sched, gen, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()


def _job(ckpt_dir, **objects) -> Job:
    cfg = RuntimeConfig(job_id="ck", control=None, ckpt_dir=str(ckpt_dir), simulated=True)
    return Job([classify(k, v) for k, v in objects.items()], cfg)


def test_round_trip_restores_objects_state_and_rng(tmp_path):
    model, opt, sched, gen = _training_objects(0)
    _train(model, opt, sched, gen, 5)
    extra = torch.arange(6.0)
    job = _job(tmp_path, model=model, optimizer=opt, scheduler=sched, batches=gen, extra=extra)
    job.step = 4
    job.state.update(epoch=3, history=[1.5, 2.5])
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    info = checkpoint.write_checkpoint(tmp_path, snapshot(job, None), job.step, "ck")
    expected_draws = (random.random(), np.random.rand(), torch.rand(3))
    _train(model, opt, sched, gen, 3)  # what the original process would have done next
    want = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2, gen2 = _training_objects(99)  # a fresh process: different init
    extra2 = torch.zeros(6)
    job2 = _job(tmp_path, model=model2, optimizer=opt2, scheduler=sched2, batches=gen2, extra=extra2)
    restore_latest(job2)
    assert job2.start_step == 5 and job2.restored_step == 4
    assert job2.state == {"epoch": 3, "history": [1.5, 2.5]}
    assert torch.equal(extra2, extra)
    assert sched2.last_epoch == 5
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1]
    assert torch.equal(draws[2], expected_draws[2])
    _train(model2, opt2, sched2, gen2, 3)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k  # bitwise, incl. AdamW moments and generator
    manifest = json.loads((tmp_path / "ckpt-000001.json").read_text())
    assert manifest["sha256"] == info.sha256 and manifest["step"] == 4


def _write(tmp_path, step: int, value: float) -> checkpoint.CheckpointInfo:
    payload = {"format": checkpoint.FORMAT, "step": step, "objects": {}, "user_state": {"v": value},
               "rng": rng.capture()}
    return checkpoint.write_checkpoint(tmp_path, payload, step)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing"])
def test_damaged_newest_falls_back_to_previous(tmp_path, capsys, damage):
    _write(tmp_path, 10, 1.0)
    newest = _write(tmp_path, 20, 2.0)
    payload = tmp_path / newest.payload
    if damage == "flip":
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(payload, payload.stat().st_size // 2)
    elif damage == "manifest":
        (tmp_path / "ckpt-000002.json").write_text("{not json")
    else:
        payload.unlink()
    info, loaded = checkpoint.load_latest(tmp_path)
    assert info.step == 10 and loaded["user_state"] == {"v": 1.0}
    assert "gpuswap:" in capsys.readouterr().err


def test_only_two_newest_are_kept_and_orphans_ignored(tmp_path):
    for step in (1, 2, 3):
        _write(tmp_path, step, float(step))
    (tmp_path / "ckpt-000009.pt").write_bytes(b"payload whose manifest never got written")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000002.json", "ckpt-000002.pt", "ckpt-000003.json", "ckpt-000003.pt",
                     "ckpt-000009.pt"]
    assert checkpoint.load_latest(tmp_path)[0].step == 3
    assert _write(tmp_path, 4, 4.0).seq == 10  # never reuses a number; the orphan is pruned
    assert not (tmp_path / "ckpt-000009.pt").exists()


@pytest.mark.parametrize("damage", ["truncate", "missing", "flip"])
def test_a_damaged_checkpoint_is_not_kept_in_place_of_the_good_one_it_fell_back_to(tmp_path, damage):
    """After a restore fell back past a truncated checkpoint, the next save kept the newest two
    by number -- the new one and the truncated one -- and deleted the good one restored from; a
    fault in the new one then left nothing to restore. A flipped byte keeps the payload's size, so
    only the restore that refused it knows (`checkpoint.distrust`)."""
    _write(tmp_path, 10, 1.0)
    bad = tmp_path / _write(tmp_path, 20, 2.0).payload
    if damage == "truncate":
        os.truncate(bad, bad.stat().st_size // 2)
    elif damage == "flip":
        data = bytearray(bad.read_bytes())
        data[len(data) // 2] ^= 0xFF
        bad.write_bytes(bytes(data))
    else:
        bad.unlink()
    assert checkpoint.load_latest(tmp_path)[0].step == 10           # the fallback
    newest = _write(tmp_path, 30, 3.0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000001.json", "ckpt-000001.pt", "ckpt-000003.json", "ckpt-000003.pt"], names
    data = bytearray((tmp_path / newest.payload).read_bytes())      # and the new one goes bad too
    data[len(data) // 2] ^= 0xFF
    (tmp_path / newest.payload).write_bytes(bytes(data))
    info, loaded = checkpoint.load_latest(tmp_path)
    assert info.step == 10 and loaded["user_state"] == {"v": 1.0}


def test_no_checkpoint_at_all(tmp_path):
    assert checkpoint.load_latest(tmp_path) is None
    assert checkpoint.load_latest(tmp_path / "absent") is None


WRITER = textwrap.dedent("""
    import sys, torch
    from gpuswap.runtime import checkpoint
    d = sys.argv[1]
    small = {"format": checkpoint.FORMAT, "step": 1, "objects": {}, "user_state": {"v": 1},
             "rng": {}}
    checkpoint.write_checkpoint(d, small, 1)
    print("first done", flush=True)
    big = dict(small, step=2, user_state={"v": 2},
               objects={"t": {"kind": "tensor", "state": [torch.ones(8 << 20) for _ in range(12)]}})
    checkpoint.write_checkpoint(d, big, 2)
    print("second done", flush=True)
""")


def test_kill_9_during_write_keeps_last_good_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first done"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until the big payload is being written
        temps = [p for p in tmp_path.iterdir() if fsutil.is_temp(p.name)]
        if temps and temps[0].stat().st_size > (1 << 20):
            break
        time.sleep(0.002)
    else:
        pytest.fail("the writer never started the second checkpoint")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert any(fsutil.is_temp(p.name) for p in tmp_path.iterdir())  # died mid-write
    info, payload = checkpoint.load_latest(tmp_path)
    assert info.step == 1 and payload["user_state"] == {"v": 1}
    _write(tmp_path, 3, 3.0)  # the next write clears the debris
    assert not any(fsutil.is_temp(p.name) for p in tmp_path.iterdir())
