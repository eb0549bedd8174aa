"""A job's newest committed disk checkpoint, read by root from its owner's files: where a pool's
node is lost for good, a job of it goes back to this checkpoint if other nodes reach it (docs/ray.md).

The manifests and parts are the job owner's files, in a directory they own. Whoever owns them can
plant a link to someone else's file, a FIFO that would block its reader for ever, a file too large
to be a manifest, JSON nested too deep to parse, or numbers of the wrong type or size. So a
manifest is opened without following a link or waiting (O_NOFOLLOW, O_NONBLOCK) and read only if
a small regular file (`fsutil.read_small`, with the runtime's own bound); every number it gives
is an int within bounds; a part is only lstat'ed.
Nothing more is verified here: the job's own restore checks every payload's sha256 and falls back
past a bad one (runtime/checkpoint.py, runtime/ckparts.py), as after any park to disk.

Which checkpoints count is what the job's restore would read, by its width (the ranks of its
process group, as its runtime reported them):

- one rank: a `gpuswap-ckpt/1` manifest (runtime/checkpoint.py); a multi-rank one is skipped;
- N ranks: a `gpuswap-ckpt/2` manifest of world size N only, by the format's commit rule
  (runtime/ckparts.py): rank 0 writes the manifest once every rank's part is durable, so a
  manifest commits, and only one named as rank 0 names it, that names exactly one part per rank
  0..N-1, all of its own seq (`ckparts.read_manifest`, the restore's own check), each part here as
  a regular file of the size it names. Parts a crash left before their manifest never count: no
  manifest names them.
"""
from __future__ import annotations

import os
import re
import stat
from typing import Any, Optional, Union

from gpuswap import fsutil
from gpuswap.runtime import ckparts
from gpuswap.runtime.checkpoint import FORMAT_PARTS, MAX_MANIFEST_BYTES, CheckpointError

MANIFEST = re.compile(r"^ckpt-(\d{1,12})\.json$")
LIMIT = 2**62           # a step, a size: anything larger is not a checkpoint's


def last_checkpoint(directory: Union[str, os.PathLike], width: int = 1) -> Optional[tuple[int, int]]:
    """(step, bytes) of the newest committed checkpoint in `directory` that a job of `width`
    ranks restores from, or None (no directory, none committed, none readable)."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        names = sorted(((int(m.group(1)), n) for n in os.listdir(dfd) if (m := MANIFEST.match(n))), reverse=True)
        for _, name in names:
            try:
                data = fsutil.read_small_json(name, MAX_MANIFEST_BYTES, dfd)
            except (OSError, ValueError):      # a link, a FIFO, too large, not JSON: not a manifest
                continue
            found = _single(data) if width == 1 else _parts(data, name, width, dfd)
            if found is not None:
                return found
        return None
    finally:
        os.close(dfd)


def _single(data: Any) -> Optional[tuple[int, int]]:
    """A single-rank manifest's (step, bytes); None for a multi-rank one or bad numbers."""
    if not isinstance(data, dict) or data.get("format") == FORMAT_PARTS:
        return None
    step, nbytes = data.get("step"), data.get("bytes")
    return (step, nbytes) if _count(step) and _count(nbytes) else None


def _parts(data: Any, name: str, width: int, dfd: int) -> Optional[tuple[int, int]]:
    """A committed `gpuswap-ckpt/2` checkpoint of `width` ranks, its manifest `name`d as rank 0
    names it (`ManifestInfo.manifest`; the runtime's prune keeps no other): its (step, bytes of all
    its parts); None where any rank's part is missing from it or from here."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_PARTS:
        return None
    parts, tick = data.get("parts"), data.get("tick")
    if (not all(_count(data.get(k)) for k in ("seq", "step", "world_size")) or data["world_size"] != width
            or not (tick is None or _count(tick)) or not isinstance(parts, list)
            or not all(isinstance(p, dict) and _count(p.get("rank")) and _count(p.get("bytes")) for p in parts)):
        return None
    try:
        info = ckparts.read_manifest(data)     # one part per rank, all of one seq: the restore's rule
    except (CheckpointError, ArithmeticError):     # its own rule broken; a number too large for a float
        return None
    if info.manifest != name or info.world_size != width or info.bytes >= LIMIT:
        return None
    for part in info.parts:                    # its own name only (read_manifest checked): no path
        try:
            st = os.stat(part.file, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != part.bytes:
            return None
    return info.step, info.bytes


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < LIMIT
