"""What a pool node's agent reads and writes as root in places users own or share (docs/ray.md):
a job's checkpoint manifests (the owner's files), the shared checkpoint directory, the runs alive
under its home. Each must hold against a hostile owner: no link followed, no FIFO waited on."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import pytest

from gpuswap.node.agent import shared_storage_id
from gpuswap.node.launcher import Launcher
from gpuswap.protocol import rundir
from gpuswap_testing import ensure_user


@pytest.fixture
def base() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="gs-pool-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def manifest(d: Path, seq: int, **fields: object) -> None:
    (d / f"ckpt-{seq:06d}.json").write_text(json.dumps({"seq": seq, "format": "gpuswap-ckpt/1", **fields}))


def test_the_last_checkpoint_is_read_without_trusting_the_owners_files(base):
    launcher = Launcher(base / "home", simulated=True, pause_timeout_s=10, ckpt_root=base / "shared")
    d = launcher.ckpt_dir(7)
    d.mkdir(parents=True)
    assert d == base / "shared" / "7"                  # on the shared storage, the same path everywhere
    assert launcher.last_checkpoint(7) is None
    manifest(d, 2, step=10, bytes=4096)
    assert launcher.last_checkpoint(7) == (10, 4096)
    # Newer "manifests" an owner could plant: each skipped, none waited on or followed.
    os.mkfifo(d / "ckpt-000003.json")                  # reading it would block for ever
    (d / "ckpt-000004.json").symlink_to("/etc/passwd")  # someone else's file
    manifest(d, 5, step="10", bytes=1)                  # not numbers
    manifest(d, 6, step=10, bytes=-1)
    (d / "ckpt-000008.json").write_bytes(b"{" + b" " * 70_000 + b"}")   # too large to be one
    manifest(d, 9, step=50, bytes=1, format="gpuswap-ckpt/2")          # a multi-rank job's parts
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(launcher.last_checkpoint(7)), daemon=True)
    t.start()
    t.join(60)
    assert done == [(10, 4096)]
    manifest(d, 10, step=60, bytes=8192)
    assert launcher.last_checkpoint(7) == (60, 8192)


def test_forgetting_a_job_deletes_its_directory_and_its_shared_checkpoints(base):
    launcher = Launcher(base / "home", simulated=True, pause_timeout_s=10, ckpt_root=base / "shared")
    run = launcher.run_dir(3, 1)
    run.mkdir(parents=True)
    launcher.ckpt_dir(3).mkdir(parents=True)
    manifest(launcher.ckpt_dir(3), 1, step=1, bytes=1)
    lock = os.open(run / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)                   # its supervisor alive: listed, and kept
    try:
        assert launcher.live_runs() == [(3, 1)]
        assert launcher.forget(3) is False and run.exists()
    finally:
        os.close(lock)
    assert launcher.live_runs() == []
    assert launcher.forget(3) is True
    assert not launcher.job_dir(3).exists() and not launcher.ckpt_dir(3).exists()


def test_a_shared_checkpoint_directory_is_used_only_if_root_owns_it(base):
    mine = base / "shared"
    first = shared_storage_id(mine)
    assert len(first) == 32 and shared_storage_id(mine) == first        # written once, read back
    assert oct(mine.stat().st_mode & 0o777) == "0o711"
    uid, gid = ensure_user("gs-pool-user")
    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, uid, gid)               # a user could plant another user's checkpoint there
    with pytest.raises(OSError, match="owns"):
        shared_storage_id(theirs)
    link = base / "link"
    link.symlink_to(mine)
    with pytest.raises(OSError, match="owns"):
        shared_storage_id(link)
