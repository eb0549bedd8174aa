"""What a pool node's agent reads and writes as root in places users own or share (docs/ray.md):
a job's checkpoint manifests (the owner's files), the shared checkpoint directory, the runs alive
under its home. Each must hold against a hostile owner: no link followed, no FIFO waited on."""
from __future__ import annotations

import fcntl
import hashlib
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
from gpuswap.runtime import checkpoint as ckpt_format
from gpuswap.runtime import ckparts
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
    manifest(d, 8, step=80, bytes=1)
    with open(d / "ckpt-000008.json", "ab") as f:                   # too large to be one, though
        f.write(b" " * ckpt_format.MAX_MANIFEST_BYTES)             # a manifest's JSON
    manifest(d, 9, step=50, bytes=1, format="gpuswap-ckpt/2")          # a multi-rank job's parts
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(launcher.last_checkpoint(7)), daemon=True)
    t.start()
    t.join(60)
    assert done == [(10, 4096)]
    manifest(d, 10, step=60, bytes=8192)
    assert launcher.last_checkpoint(7) == (60, 8192)
    (d / "ckpt-000011.json").write_text("[" * 60_000)    # nested too deep for the parser: skipped
    assert launcher.last_checkpoint(7) == (60, 8192)
    assert launcher.last_checkpoint(7, width=2) is None   # no checkpoint of 2 ranks among them


def part(d: Path, seq: int, rank: int, size: int = 100) -> dict[str, object]:
    """Rank `rank`'s part of checkpoint `seq`, durable, as the rank reports it (`write_part`)."""
    data = os.urandom(size)
    (d / ckparts.part_name(seq, rank)).write_bytes(data)
    return {"rank": rank, "file": ckparts.part_name(seq, rank), "bytes": size,
            "sha256": hashlib.sha256(data).hexdigest()}


def parts_manifest(d: Path, name: int, step: object, parts: list[dict[str, object]], **fields: object) -> None:
    """`ckpt-NAME.json`, a `gpuswap-ckpt/2` manifest as rank 0 writes it, with `fields` changed (a
    hostile owner's)."""
    doc = {"format": ckparts.FORMAT, "seq": name, "step": step, "tick": 0, "world_size": len(parts),
           "parts": parts, "job_id": "7", "host": "h", "created_unix": 1.0, **fields}
    (d / f"ckpt-{name:06d}.json").write_text(json.dumps(doc))


def test_a_multi_rank_checkpoint_counts_only_with_every_ranks_part_committed(base):
    """A job of 2 ranks goes back only to a checkpoint whose manifest names one part per rank of
    its own seq, each part here at its size; whatever else an owner or a crash left is skipped."""
    launcher = Launcher(base / "home", simulated=True, pause_timeout_s=10, ckpt_root=base / "shared")
    d = launcher.ckpt_dir(7)
    d.mkdir(parents=True)
    # The runtime's own commit (rank 0, once both parts are durable).
    ckparts.write_manifest(d, [part(d, 1, 0, 300), part(d, 1, 1, 200)], step=12, tick=12, world_size=2)
    assert launcher.last_checkpoint(7, width=2) == (12, 500)
    assert launcher.last_checkpoint(7) is None            # a single-rank job never reads parts
    assert launcher.last_checkpoint(7, width=3) is None   # nor a job of another width
    # Newer ones, each not a committed checkpoint of 2 ranks:
    part(d, 2, 0), part(d, 2, 1)                          # both parts, no manifest: a crash before the commit
    parts_manifest(d, 3, 30, [part(d, 3, 0)], world_size=2)                     # rank 1's part not named
    parts_manifest(d, 4, 40, [part(d, 4, 0)])                                  # a job of 1 rank's parts
    p5 = [part(d, 5, 0), part(d, 5, 1)]
    (d / ckparts.part_name(5, 1)).unlink()                                      # rank 1's part gone
    parts_manifest(d, 5, 50, p5)
    p6 = [part(d, 6, 0), part(d, 6, 1)]
    (d / ckparts.part_name(6, 1)).write_bytes(b"short")                         # not the size named
    parts_manifest(d, 6, 60, p6)
    p7 = [part(d, 7, 0), part(d, 7, 1)]
    (d / ckparts.part_name(7, 1)).unlink()
    (d / ckparts.part_name(7, 1)).symlink_to("/etc/passwd")                    # a link, not a part
    parts_manifest(d, 7, 70, [p7[0], dict(p7[1], bytes=os.stat("/etc/passwd").st_size)])
    p8 = [part(d, 8, 0), part(d, 8, 1)]
    (d / ckparts.part_name(8, 1)).unlink()
    os.mkfifo(d / ckparts.part_name(8, 1))                                     # a FIFO: never opened
    parts_manifest(d, 8, 80, p8)
    parts_manifest(d, 9, 90, [part(d, 9, 0), dict(part(d, 9, 1), file=ckparts.part_name(2, 1))])  # of two
    parts_manifest(d, 10, 100, [part(d, 11, 0), part(d, 11, 1)], seq=11)       # another seq's, under this name
    parts_manifest(d, 12, 120, [part(d, 12, 0), part(d, 12, 0)])               # rank 0 twice
    parts_manifest(d, 13, 130, [part(d, 13, 0), dict(part(d, 13, 1), file="../../etc/passwd")])
    parts_manifest(d, 14, "140", [part(d, 14, 0), part(d, 14, 1)])             # not numbers
    parts_manifest(d, 15, 150, [part(d, 15, 0), dict(part(d, 15, 1), bytes=100.0)])
    parts_manifest(d, 16, 160, [part(d, 16, 0), dict(part(d, 16, 1), rank=True)])
    parts_manifest(d, 17, -1, [part(d, 17, 0), part(d, 17, 1)])
    parts_manifest(d, 18, 180, [part(d, 18, 0), part(d, 18, 1)], world_size=2.0)
    parts_manifest(d, 19, 190, [part(d, 19, 0), dict(part(d, 19, 1), sha256="0" * 63)])
    parts_manifest(d, 20, 200, [part(d, 20, 0), part(d, 20, 1)], format="gpuswap-ckpt/1")
    manifest(d, 21, step=210, bytes=1)                                          # a single-rank job's
    os.mkfifo(d / "ckpt-000022.json")
    (d / "ckpt-000023.json").symlink_to(d / "ckpt-000001.json")
    (d / "ckpt-000024.json").write_text("[" * 60_000)
    (d / "ckpt-000025.json").write_bytes(b"\xff\xfe not UTF-8")
    parts_manifest(d, 28, 280, [part(d, 28, 0), part(d, 28, 1)], created_unix=10**400)   # no float
    parts_manifest(d, 27, 270, [part(d, 27, 0), part(d, 27, 1)])
    (d / "ckpt-000027.json").rename(d / "ckpt-27.json")                        # not the name rank 0 gives it
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(launcher.last_checkpoint(7, width=2)), daemon=True)
    t.start()
    t.join(60)
    assert done == [(12, 500)]
    # A newer commit of both parts is the one: the step its manifest names, the bytes of both (and
    # its prune, in the job's process, neither waits on the FIFO nor fails on the deep JSON).
    ckparts.write_manifest(d, [part(d, 26, 0, 64), part(d, 26, 1, 32)], step=260, tick=None, world_size=2)
    assert launcher.last_checkpoint(7, width=2) == (260, 96)


def test_a_wide_jobs_manifest_is_not_too_large_to_count(base):
    """A 1024-rank job's manifest (the widest a job may be) is ~170 KB: still a manifest."""
    launcher = Launcher(base / "home", simulated=True, pause_timeout_s=10, ckpt_root=base / "shared")
    d = launcher.ckpt_dir(7)
    d.mkdir(parents=True)
    world = ckparts.MAX_WORLD
    ckparts.write_manifest(d, [part(d, 1, r, 1) for r in range(world)], step=5, tick=5, world_size=world)
    assert (d / "ckpt-000001.json").stat().st_size > 100_000
    assert launcher.last_checkpoint(7, width=world) == (5, world)


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
