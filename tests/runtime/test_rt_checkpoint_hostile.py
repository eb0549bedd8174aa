"""What else a job's checkpoint directory may hold under a manifest's name, put there by its owner
by hand or by accident: a FIFO, a directory, a link (to a FIFO, to /dev/zero), JSON nested too
deep to parse, a file too large to be a manifest, numbers of the wrong kind. Saving, pruning and
restoring run inside the training process (runtime/checkpoint.py, runtime/ckparts.py): each must
go on past such a file, never hang on it, never crash on it, never read it whole.

Each save or restore runs where a hang fails its test instead of hanging the suite: in a thread
given a generous time, or (the link to /dev/zero, which a regression would read until memory
runs out) in a child process with its address space capped."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from gpuswap.runtime import checkpoint, ckparts, rng

HANG_S = 60     # a cap on a hang, not a window: every call here returns in well under a second


def _would_be(p: Path, seq: object = 3) -> bytes:
    """The JSON of a manifest of checkpoint 3, in the format of the checkpoints beside `p`, its
    seq field `seq`: what a plant would commit if it were read as a manifest."""
    doc = json.loads((p.parent / "ckpt-000002.json").read_text())
    if doc.get("format") == ckparts.FORMAT:
        doc["parts"] = [dict(part, file=ckparts.part_name(3, part["rank"])) for part in doc["parts"]]
    else:
        doc["payload"] = "ckpt-000003.pt"
    return json.dumps(dict(doc, seq=seq), indent=1).encode()


def _fifo_elsewhere(p: Path) -> None:
    fifo = p.parent.parent / f"{p.parent.name}.fifo"
    os.mkfifo(fifo)
    p.symlink_to(fifo)


PLANTS: dict[str, Callable[[Path], Any]] = {
    "fifo": os.mkfifo,                                   # reading it would wait for a writer for ever
    "link-to-fifo": _fifo_elsewhere,                     # the same, unless the link is not followed
    "directory": Path.mkdir,
    "nested-json": lambda p: p.write_text("[" * 100_000),            # RecursionError in json
    "too-large": lambda p: p.write_bytes(_would_be(p) + b" " * checkpoint.MAX_MANIFEST_BYTES),
    "seq-infinite": lambda p: p.write_bytes(_would_be(p, float("inf"))),   # int(inf): OverflowError
    "seq-a-string": lambda p: p.write_bytes(_would_be(p, "3")),             # int("3") would take it
}


def _bounded(fn: Callable[[], Any]) -> Any:
    """fn(), run in a thread so that a hang fails the test (after HANG_S) rather than the suite."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:      # re-raised in the test below
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"still running after {HANG_S} s: it hangs"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _write(d: Path, step: int) -> checkpoint.CheckpointInfo:
    payload = {"format": checkpoint.FORMAT, "step": step, "objects": {}, "user_state": {"v": step},
               "rng": rng.capture()}
    return checkpoint.write_checkpoint(d, payload, step)


def _commit(d: Path, step: int) -> ckparts.ManifestInfo:
    """A 2-rank checkpoint: both parts, then rank 0's manifest (and its prune)."""
    seq = ckparts.next_seq(d)
    parts = [ckparts.write_part(d, {"format": ckparts.FORMAT, "rank": r, "world_size": 2, "step": step,
                                    "tick": step, "job_id": "j", "shared": {}, "own": {},
                                    "user_state": {"v": step}, "rng": rng.capture()}, seq)
             for r in (1, 0)]
    return ckparts.write_manifest(d, parts, step=step, tick=step, world_size=2, job_id="j")


def _left(plant: str) -> list[str]:
    """What a prune after checkpoints 2 and 4 leaves besides them: the plant at seq 3 is debris
    older than the newest checkpoint, removed unless a directory (not ours to remove)."""
    return ["ckpt-000003.json"] if plant == "directory" else []


@pytest.mark.parametrize("plant", PLANTS)
def test_single_rank_save_prune_and_restore_go_past_it(tmp_path, plant):
    d = tmp_path / "ckpt"
    _write(d, 10)
    _write(d, 20)
    PLANTS[plant](d / "ckpt-000003.json")
    info, payload, note = _bounded(lambda: checkpoint.choose(d, env={}))
    assert info.seq == 2 and payload["user_state"] == {"v": 20}
    assert "ckpt-000003.json" in note                       # said, not silently skipped
    assert _bounded(lambda: _write(d, 40)).seq == 4          # the name still takes seq 3
    names = sorted(e.name for e in d.iterdir())
    assert names == sorted(["ckpt-000002.json", "ckpt-000002.pt", "ckpt-000004.json", "ckpt-000004.pt",
                            *_left(plant)]), names
    assert _bounded(lambda: checkpoint.load_latest(d))[0].step == 40


@pytest.mark.parametrize("plant", PLANTS)
def test_multi_rank_commit_prune_and_restore_go_past_it(tmp_path, plant):
    d = tmp_path / "ckpt"
    _commit(d, 10)
    _commit(d, 20)
    PLANTS[plant](d / "ckpt-000003.json")
    chosen, note = _bounded(lambda: ckparts.choose(d, 1, 2, env={}))
    assert chosen.info.seq == 2 and chosen.own["user_state"] == {"v": 20}
    assert "seq 3" in note
    assert _bounded(lambda: _commit(d, 40)).seq == 4
    names = sorted(e.name for e in d.iterdir())
    assert names == sorted(["ckpt-000002.json", "ckpt-000002.r0.pt", "ckpt-000002.r1.pt",
                            "ckpt-000004.json", "ckpt-000004.r0.pt", "ckpt-000004.r1.pt",
                            *_left(plant)]), names
    assert _bounded(lambda: ckparts.choose(d, 0, 2, env={}))[0].info.step == 40


LINK_TO_DEV_ZERO = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from gpuswap.runtime import checkpoint, ckparts, rng

    one, two = Path(sys.argv[1]) / "one", Path(sys.argv[1]) / "two"
    payload = lambda step: {"format": checkpoint.FORMAT, "step": step, "objects": {}, "user_state": {},
                            "rng": rng.capture()}
    part = lambda r, step: {"format": ckparts.FORMAT, "rank": r, "world_size": 2, "step": step,
                            "tick": step, "job_id": "j", "shared": {}, "own": {}, "user_state": {},
                            "rng": rng.capture()}
    checkpoint.write_checkpoint(one, payload(10), 10)
    (one / "ckpt-000002.json").symlink_to("/dev/zero")
    first, _, note = checkpoint.choose(one, env={})
    second = checkpoint.write_checkpoint(one, payload(30), 30)
    ckparts.write_manifest(two, [ckparts.write_part(two, part(r, 10), 1) for r in (1, 0)], step=10,
                           tick=10, world_size=2)
    (two / "ckpt-000002.json").symlink_to("/dev/zero")
    chosen, note2 = ckparts.choose(two, 0, 2, env={})
    third = ckparts.write_manifest(two, [ckparts.write_part(two, part(r, 30), 3) for r in (1, 0)],
                                   step=30, tick=30, world_size=2)
    print(json.dumps({"restored": [first.step, chosen.info.step], "saved": [second.seq, third.seq],
                      "said": ["ckpt-000002.json" in note, "seq 2" in note2],
                      "left": sorted(e.name for d in (one, two) for e in d.iterdir() if e.is_symlink())}))
""")


def _cap_memory() -> None:
    cap = 4 << 30        # enough for torch on the CPU; reading /dev/zero whole meets it in seconds
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def test_a_link_to_dev_zero_is_never_read(tmp_path):
    done = subprocess.run([sys.executable, "-c", LINK_TO_DEV_ZERO, str(tmp_path)], capture_output=True,
                          text=True, timeout=HANG_S, preexec_fn=_cap_memory)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"restored": [10, 10], "saved": [3, 3], "said": [True, True],
                                       "left": []}
