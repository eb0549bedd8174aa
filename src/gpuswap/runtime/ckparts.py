"""The multi-rank checkpoint on disk (`gpuswap-ckpt/2`): one part per rank, one manifest.

Layout, in the same `$GPUSWAP_CKPT_DIR` as the single-rank format (docs/runtime.md)::

    ckpt-000009.r0.pt    rank 0's part: the replicated state (DDP) and its own
    ckpt-000009.r1.pt    rank 1's part: its own state only (RNG, job.state, shards)
    ckpt-000009.json     the manifest, written by rank 0 after every part is durable; its
                         existence commits checkpoint 9

Every rank writes its part with the single-rank writer (temp file, sha256 while streaming,
fsync, rename, fsync the directory) and reports `{rank, file, bytes, sha256, seconds}`; the
coordinator hands the list to rank 0 (`commit`), which writes the manifest, fsyncs the directory
and prunes. A crash before the manifest leaves the previous checkpoint standing; the orphan parts
are deleted by the next commit and never read, since only a manifest names what to read.

Why `seq` comes from the manifests: every rank must name its part with the same number without
talking. The ranks write parts only while every rank stands at the common step and nobody writes
a manifest (that happens once all parts are in), so "newest manifest + 1" is the same on all.

Why every rank verifies every part at restore: the ranks must all restore the same checkpoint,
and they choose without talking; reading the same files they reach the same verdict. Rank r then
loads its own part and rank 0's (for the replicated state).
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpuswap import fsutil
from gpuswap.protocol.env import RESTART_ON_BAD_CHECKPOINT
from gpuswap.runtime import checkpoint
from gpuswap.runtime.checkpoint import CheckpointError, NoUsableCheckpoint

FORMAT = "gpuswap-ckpt/2"
_PART = re.compile(r"^ckpt-(\d{6,})\.r(\d+)\.pt$")
_MANIFEST_NAME = re.compile(r"^ckpt-(\d+)\.json$")
MAX_WORLD = 1024          # the bound protocol/messages.py puts on a hello's world_size


@dataclass(frozen=True)
class PartInfo:
    rank: int
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ManifestInfo:
    """One committed multi-rank checkpoint, as its manifest describes it."""

    seq: int
    step: int
    tick: int | None
    world_size: int
    parts: tuple[PartInfo, ...]
    created_unix: float
    job_id: str | None = None
    host: str | None = None
    format: str = FORMAT

    @property
    def manifest(self) -> str:
        return f"ckpt-{self.seq:06d}.json"

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def part(self, rank: int) -> PartInfo:
        return self.parts[rank]


@dataclass
class Chosen:
    """What a rank restores: the checkpoint, its own part's payload and rank 0's (the same dict
    on rank 0). `note` says which newer checkpoints were skipped and why."""

    info: ManifestInfo
    own: dict[str, Any]
    shared: dict[str, Any]
    note: str | None = None
    seconds: float = 0.0
    rejected: list[str] = field(default_factory=list)


def part_name(seq: int, rank: int) -> str:
    return f"ckpt-{seq:06d}.r{rank}.pt"


def next_seq(directory: str | os.PathLike) -> int:
    """1 + the newest manifest's seq (by name, readable or not): the same on every rank while
    the ranks write their parts (see the module docstring)."""
    d = Path(directory)
    if not d.is_dir():
        return 1
    seqs = [int(m.group(1)) for e in d.iterdir() if (m := _MANIFEST_NAME.match(e.name))]
    return max(seqs, default=0) + 1


def write_part(directory: str | os.PathLike, payload: dict[str, Any], seq: int | None = None) -> dict[str, Any]:
    """Durably write this rank's part (`rankstate.part_payload`'s dict) for checkpoint `seq`
    (default: `next_seq`). Returns `{rank, file, bytes, sha256, seconds}`: the `part` message's
    fields. Not yet a checkpoint: only rank 0's manifest makes it one."""
    import torch

    t0 = time.perf_counter()
    rank, world = int(payload["rank"]), int(payload["world_size"])
    if payload.get("format") != FORMAT or not 0 <= rank < world:
        raise CheckpointError(f"not a {FORMAT} part payload for a rank in [0, {world})")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    seq = next_seq(d) if seq is None else int(seq)
    name = part_name(seq, rank)
    size, digest = checkpoint._write_file_atomic(d, name, lambda f: torch.save(payload, f))
    checkpoint._fsync_dir(d)            # the rename is durable before the part is reported
    return {"rank": rank, "file": name, "bytes": size, "sha256": digest,
            "seconds": round(time.perf_counter() - t0, 6)}


def _parts_from(raw: Any, world_size: int) -> tuple[int, tuple[PartInfo, ...]]:
    """Validated parts of a commit or manifest: ranks 0..world_size-1 once each, names of one
    seq (no paths), sizes and digests present. Returns (seq, parts by rank)."""
    if not isinstance(raw, list) or len(raw) != world_size:
        raise CheckpointError(f"expected {world_size} parts, got {len(raw) if isinstance(raw, list) else raw!r}")
    by_rank: dict[int, PartInfo] = {}
    seqs = set()
    for p in raw:
        try:
            info = PartInfo(rank=int(p["rank"]), file=str(p["file"]), bytes=int(p["bytes"]),
                            sha256=str(p["sha256"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed part entry {p!r}: {exc}") from None
        m = _PART.match(info.file)
        if m is None or int(m.group(2)) != info.rank or not re.fullmatch(r"[0-9a-f]{64}", info.sha256):
            raise CheckpointError(f"part entry {p!r} does not name rank {info.rank}'s part file")
        if info.rank in by_rank or not 0 <= info.rank < world_size:
            raise CheckpointError(f"part of rank {info.rank} listed twice or out of range")
        by_rank[info.rank] = info
        seqs.add(int(m.group(1)))
    if len(seqs) != 1:
        raise CheckpointError(f"parts of different checkpoints: seq {sorted(seqs)}")
    return seqs.pop(), tuple(by_rank[r] for r in range(world_size))


def write_manifest(directory: str | os.PathLike, parts: list[dict[str, Any]], *, step: int,
                   tick: int | None, world_size: int, job_id: str | None = None,
                   attach: int | None = None) -> ManifestInfo:
    """Rank 0, once every part is durable (`commit{e,parts}`): commit the checkpoint by writing
    its manifest, fsync the directory, prune (manifests first, then their parts; orphan parts
    and stale temp files go too). Each listed part must exist with its reported size."""
    d = Path(directory)
    if not 1 <= int(world_size) <= MAX_WORLD:
        raise CheckpointError(f"world size {world_size} out of range")
    seq, infos = _parts_from(parts, int(world_size))
    for p in infos:
        try:
            size = (d / p.file).stat().st_size
        except OSError as exc:
            raise CheckpointError(f"part {p.file} of rank {p.rank} is missing: {exc}") from None
        if size != p.bytes:
            raise CheckpointError(f"part {p.file} has {size} bytes, rank {p.rank} reported {p.bytes}")
    info = ManifestInfo(seq=seq, step=int(step), tick=None if tick is None else int(tick),
                        world_size=int(world_size), parts=infos, created_unix=time.time(),
                        job_id=job_id, host=socket.gethostname())
    doc = {"format": FORMAT, "seq": info.seq, "step": info.step, "tick": info.tick,
           "world_size": info.world_size,
           "parts": [{"rank": p.rank, "file": p.file, "bytes": p.bytes, "sha256": p.sha256} for p in infos],
           "job_id": job_id, "host": info.host, "created_unix": info.created_unix}
    if attach is not None:      # which attach of the process wrote it (each part says so too)
        doc["attach"] = int(attach)
    text = json.dumps(doc, indent=1).encode()
    checkpoint._write_file_atomic(d, info.manifest, lambda f: f.write(text))
    checkpoint._fsync_dir(d)
    checkpoint._remove_stale_temps(d)     # every part is renamed: any temp left is a dead write's
    checkpoint._prune(d, keep=checkpoint.KEEP)
    return info


def read_manifest(raw: Mapping[str, Any]) -> ManifestInfo:
    """A `gpuswap-ckpt/2` manifest's JSON as a ManifestInfo; CheckpointError if malformed."""
    try:
        world = int(raw["world_size"])
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world size {world} out of range")
        seq, parts = _parts_from(raw["parts"], world)
        if seq != int(raw["seq"]):
            raise ValueError(f"parts are of seq {seq}, the manifest says {raw['seq']}")
        tick = raw.get("tick")
        return ManifestInfo(seq=seq, step=int(raw["step"]), tick=None if tick is None else int(tick),
                            world_size=world, parts=parts, created_unix=float(raw.get("created_unix") or 0),
                            job_id=raw.get("job_id"), host=raw.get("host"))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:   # OverflowError: int(1e999)
        raise CheckpointError(f"malformed {FORMAT} manifest: {exc}") from None


def _ranks(n: int) -> str:
    return f"{n} rank" + ("" if n == 1 else "s")


def _load(directory: Path, info: ManifestInfo, rank: int, mmap: bool) -> dict[str, Any]:
    import torch

    path = directory / info.part(rank).file
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"part {path.name} does not load: {exc}") from exc
    if (not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("rank") != rank
            or payload.get("world_size") != info.world_size):
        raise CheckpointError(f"part {path.name} is not rank {rank}'s {FORMAT} part of {_ranks(info.world_size)}")
    return payload


def _try(d: Path, raw: Any, name: str, rank: int, world_size: int) -> tuple[ManifestInfo, dict, dict]:
    if not isinstance(raw, dict):
        raise CheckpointError(f"manifest {name} is not an object")
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint written by 1 rank, the job now has {world_size}")
    info = read_manifest(raw)
    if info.world_size != world_size:
        raise CheckpointError(f"checkpoint written by {_ranks(info.world_size)}, the job now has {world_size}")
    for p in info.parts:                 # all of them: every rank must reach the same verdict
        checkpoint.verify(d, checkpoint.CheckpointInfo(seq=info.seq, step=info.step, payload=p.file,
                                                       bytes=p.bytes, sha256=p.sha256, created_unix=0))
    own = _load(d, info, rank, mmap=False)
    shared = own if rank == 0 else _load(d, info, 0, mmap=True)  # only its shared entries are read
    return info, own, shared


def choose(directory: str | os.PathLike | None, rank: int, world_size: int,
           env: Mapping[str, str] = os.environ, job_id: str | None = None) -> tuple[Chosen | None, str | None]:
    """What rank `rank` of a `world_size`-rank job restores, and a note: the newest committed
    checkpoint of this world size whose every part verifies (size, sha256) and whose needed parts
    load. Newer unusable ones are skipped, and the note says which and why, as in the single-rank
    `checkpoint.choose`. No checkpoint at all: (None, None). Checkpoints but none usable:
    NoUsableCheckpoint, unless the job's environment has GPUSWAP_RESTART_ON_BAD_CHECKPOINT=1
    (then (None, note): it starts from step 0 and says why). The newest usable one written by
    another job than `job_id`: ForeignCheckpoint (`checkpoint.check_owner`), on every rank alike."""
    t0 = time.perf_counter()
    d = Path(directory) if directory else None
    if d is None or not d.is_dir():
        return None, None
    manifests = sorted(((int(m.group(1)), e) for e in d.iterdir() if (m := _MANIFEST_NAME.match(e.name))),
                       key=lambda x: x[0], reverse=True)
    rejected: list[str] = []
    for seq, entry in manifests:
        raw: Any = None
        try:
            try:   # bounded, no link followed, no FIFO waited on: see runtime/checkpoint.py
                raw = fsutil.read_small_json(entry, checkpoint.MAX_MANIFEST_BYTES)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"manifest {entry.name} is unreadable ({exc})") from None
            info, own, shared = _try(d, raw, entry.name, rank, world_size)
        except CheckpointError as exc:
            step = raw.get("step") if isinstance(raw, dict) else None
            checkpoint._warn(f"checkpoint seq {seq} is unusable: {exc}")
            rejected.append(f"seq {seq}" + (f" (step {step})" if step is not None else "") + f": {exc}")
            continue
        checkpoint.check_owner(info.job_id, job_id, info.seq, info.step, d, env)
        note = (f"newer checkpoint(s) unusable, used seq {info.seq} (step {info.step}) instead: "
                + "; ".join(rejected)) if rejected else None
        return Chosen(info, own, shared, note, round(time.perf_counter() - t0, 6), rejected), note
    if not rejected:
        return None, None
    why = "no usable checkpoint: " + "; ".join(rejected)
    if env.get(RESTART_ON_BAD_CHECKPOINT, "").strip() == "1":
        return None, f"{why}; restarted from step 0 as {RESTART_ON_BAD_CHECKPOINT}=1 asks"
    raise NoUsableCheckpoint(f"{why}; not restarting from step 0 (set {RESTART_ON_BAD_CHECKPOINT}=1 in "
                             "the job's environment to allow that)")
