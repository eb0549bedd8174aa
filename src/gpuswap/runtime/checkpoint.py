"""Atomic, checksummed checkpoints in `$GPUSWAP_CKPT_DIR`.

Layout (see docs/runtime.md)::

    ckpt-000007.pt     payload: torch.save of a dict (format, step, objects, user_state, rng)
    ckpt-000007.json   manifest: sha256 and size of the payload; its presence commits the checkpoint
    .NAME.PID.tmp      a write in progress (or one killed mid-way); ignored, removed by the next write

Multi-rank jobs write `gpuswap-ckpt/2` (one part per rank and a manifest, runtime/ckparts.py) in
the same directory; this module reads only format 1, skips format 2 with its world size as the
reason, and prunes both.

A checkpoint is written as: payload to a temp file in the same directory (sha256 computed while
streaming), fsync, rename; manifest the same way; fsync the directory. A crash at any point leaves
the previous complete checkpoint untouched, and readers only trust a payload whose manifest exists
and whose bytes hash to the manifest's sha256. The two newest complete checkpoints are kept so a
newest one that later turns out corrupt falls back to the previous one.

The directory is the job owner's, and this code runs inside their training process: whatever
else lies there under a checkpoint's name (a FIFO, a directory, a link to /dev/zero, a huge file,
JSON nested too deep to parse, numbers of the wrong type) must neither hang nor crash training.
Manifests are read with `fsutil.read_small` (no link followed, no FIFO waited on, at most
MAX_MANIFEST_BYTES): such a file is not a manifest, is reported as unreadable by a restore, and
is pruned as debris (a directory excepted: left alone).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Mapping

from gpuswap import fsutil
from gpuswap.protocol.env import ADOPT_CHECKPOINTS, CKPT_DIR, RESTART_ON_BAD_CHECKPOINT

FORMAT = "gpuswap-ckpt/1"
FORMAT_PARTS = "gpuswap-ckpt/2"   # multi-rank: one part per rank (runtime/ckparts.py)
KEEP = 2
_MANIFEST = re.compile(r"^ckpt-(\d+)\.json$")
_CHUNK = 8 << 20
MAX_MANIFEST_BYTES = 1 << 20      # a 1024-rank gpuswap-ckpt/2 manifest is ~170 KB


class CheckpointError(Exception):
    """A checkpoint could not be read or verified."""


class NoUsableCheckpoint(CheckpointError):
    """Checkpoints exist but none is usable, and the job did not ask to start over."""


class ForeignCheckpoint(NoUsableCheckpoint):
    """The checkpoint a job would resume from was written by another job (`check_owner`)."""


def check_owner(written_by: Any, job_id: str | None, seq: int, step: Any, directory: str | os.PathLike,
                env: Mapping[str, str] = os.environ) -> None:
    """Refuse to resume job `job_id` from a checkpoint another job wrote, unless the job's
    environment names that job in GPUSWAP_ADOPT_CHECKPOINTS.

    A job's own checkpoints carry its id across requeues (the daemon's job id; under Slurm
    $SLURM_JOB_ID, which a requeue keeps), so a different id means the directory is shared: two
    jobs given one $GPUSWAP_CKPT_DIR (a job array with a fixed directory, a copied script). The
    second one used to restore the first one's weights silently and train on from its step, and
    each pruned the other's files. Starting from step 0 instead would still mix the two in one
    directory, so nothing is restored and nothing written: the job ends with one line that says
    whose checkpoint it is and what to do. A checkpoint or a job without an id (a runtime outside
    gpuswap and Slurm, or a checkpoint of a release before ids) is not judged."""
    if written_by in (None, "") or not job_id or str(written_by) == str(job_id):
        return
    if env.get(ADOPT_CHECKPOINTS, "").strip() == str(written_by):
        _warn(f"resuming from checkpoint seq {seq} (step {step}) of job {str(written_by)[:80]}, as "
              f"{ADOPT_CHECKPOINTS} asks")
        return
    raise ForeignCheckpoint(
        f"checkpoint seq {seq} (step {step}) in {directory} was written by job {str(written_by)[:80]}, "
        f"not by this job ({job_id}): not resuming another job's state; give each job its own "
        f"{CKPT_DIR}, or set {ADOPT_CHECKPOINTS}={str(written_by)[:80]} to continue that job's training")


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as described by its manifest."""

    seq: int
    step: int
    payload: str  # file name, relative to the checkpoint directory
    bytes: int
    sha256: str
    created_unix: float
    job_id: str | None = None
    host: str | None = None
    format: str = FORMAT
    attach: int | None = None     # which attach of its process wrote it (`attach_of`); None: not recorded

    def manifest_dict(self) -> dict[str, Any]:
        return asdict(self)


# Bytes this process has written to checkpoint files, ever (monotonic): a multi-rank job's usage
# reports carry it, so that its coordinator tells a part still being written (a slow disk, a large
# job) from a rank that is stuck (runtime/agreement.py `poll`). Read from another thread: an int.
_written = 0
_PIECE = 64 << 20     # a large storage is written (and counted) in pieces: progress shows during it


def bytes_written() -> int:
    return _written


class _HashingWriter:
    """File-like sink for torch.save that hashes and counts bytes as they stream to disk."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        global _written
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        for i in range(0, view.nbytes, _PIECE):
            piece = view[i:i + _PIECE]
            self.sha.update(piece)
            self._f.write(piece)
            self.size += piece.nbytes
            _written += piece.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomic(directory: Path, name: str, write) -> tuple[int, str]:
    """Write via `write(file_like)` atomically (gpuswap.fsutil). Returns (size, sha256)."""
    sinks: list[_HashingWriter] = []

    def hashed(f: BinaryIO) -> None:
        sinks.append(_HashingWriter(f))
        write(sinks[0])

    fsutil.atomic_write(directory / name, hashed)
    return sinks[0].size, sinks[0].sha.hexdigest()


def list_checkpoints(directory: str | os.PathLike, unreadable: list[str] | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints (those with a readable manifest), newest first. Unverified.
    A manifest that exists but cannot be read is a committed checkpoint gone bad: it is skipped
    and, if `unreadable` is given, described there."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found: list[CheckpointInfo] = []
    for entry in sorted(d.iterdir(), reverse=True):
        if not _MANIFEST.match(entry.name):
            continue
        try:
            raw = fsutil.read_small_json(entry, MAX_MANIFEST_BYTES)
            if isinstance(raw, dict) and raw.get("format") == FORMAT_PARTS:
                # a multi-rank checkpoint (runtime/ckparts.py): never this single-rank job's
                if unreadable is not None:
                    unreadable.append(f"seq {raw.get('seq')} (step {raw.get('step')}): checkpoint "
                                      f"written by {raw.get('world_size')} ranks, the job now has 1")
                continue
            info = _info(raw)
        except (OSError, ValueError, TypeError) as exc:
            _warn(f"ignoring unreadable checkpoint manifest {entry}: {exc}")
            if unreadable is not None:
                unreadable.append(f"manifest {entry.name} is unreadable ({exc})")
            continue
        found.append(info)
    found.sort(key=lambda i: i.seq, reverse=True)
    return found


def _info(raw: Any) -> CheckpointInfo:
    """A format-1 manifest's JSON as a CheckpointInfo; TypeError or ValueError if malformed: the
    numbers are sorted and compared later, and the payload is a file of this directory."""
    if not isinstance(raw, dict):
        raise TypeError("manifest is not a JSON object")
    known = {k: raw[k] for k in CheckpointInfo.__dataclass_fields__ if k in raw}
    info = CheckpointInfo(**known)  # unknown keys: written by a newer gpuswap; ignore
    if (not all(type(v) is int for v in (info.seq, info.step, info.bytes))
            or not isinstance(info.payload, str) or not re.fullmatch(r"ckpt-\d+\.pt", info.payload)
            or not isinstance(info.sha256, str)
            or not (info.attach is None or (type(info.attach) is int and info.attach >= 1))):
        raise ValueError("manifest has a field of the wrong type or a payload that is no checkpoint file")
    return info


def _next_seq(d: Path) -> int:
    seqs = [int(m.group(1)) for e in d.iterdir() if (m := re.match(r"^ckpt-(\d+)\.", e.name))]
    return max(seqs, default=0) + 1


def write_checkpoint(
    directory: str | os.PathLike, payload: dict[str, Any], step: int, job_id: str | None = None
) -> CheckpointInfo:
    """Durably write `payload` (torch.save-able) as a new checkpoint; prune all but the newest KEEP."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(d)
    seq = _next_seq(d)
    stem = f"ckpt-{seq:06d}"
    size, digest = _write_file_atomic(d, stem + ".pt", lambda f: torch.save(payload, f))
    info = CheckpointInfo(
        seq=seq, step=int(step), payload=stem + ".pt", bytes=size, sha256=digest,
        created_unix=time.time(), job_id=job_id, host=socket.gethostname(), attach=payload.get("attach"),
    )
    text = json.dumps(info.manifest_dict(), indent=1).encode()
    _write_file_atomic(d, stem + ".json", lambda f: f.write(text))
    _fsync_dir(d)
    _prune(d, keep=KEEP)
    return info


def _remove_stale_temps(d: Path) -> None:
    for e in d.iterdir():
        if fsutil.is_temp(e.name) or e.name.startswith(".tmp-"):    # .tmp-*: releases before 0.1.0's end
            _unlink(e)


def _unlink(e: Path) -> None:
    """Remove a file of ours; a directory under such a name is not ours to remove (nor a reason
    to crash training)."""
    try:
        e.unlink(missing_ok=True)
    except IsADirectoryError:
        pass


def _manifest_files(raw: Any) -> tuple[int, list[str], dict[str, Any]] | None:
    """(seq, data files, file -> the size the manifest says it has) a manifest of either format
    names; None if it names none usable. Its seq must be an int, as every writer writes it: a
    "3" or 1e999 is nobody's commit, and counting it would prune a real checkpoint in its place."""
    if not isinstance(raw, dict) or type(raw.get("seq")) is not int:
        return None
    try:
        seq = raw["seq"]
        if raw.get("format") == FORMAT_PARTS:
            sizes = {str(p["file"]): p.get("bytes") for p in raw["parts"]}
        else:
            sizes = {str(raw["payload"]): raw.get("bytes")}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    files = [f for f in sizes if re.fullmatch(r"ckpt-\d+\.(r\d+\.)?pt", f)]
    return seq, files, sizes


def _sizes_match(d: Path, sizes: dict[str, Any]) -> bool:
    """Every file the manifest names is there with the size it says: a cheap test (a stat per
    file) that a truncated or missing payload fails, the usual damage; sha256 is for restores."""
    for name, size in sizes.items():
        try:
            if type(size) is not int or os.lstat(d / name).st_size != size:
                return False
        except OSError:
            return False
    return True


# Per directory (resolved), the seqs whose files this process found damaged: `_prune` never counts
# them among the kept. A damaged payload of the right size passes `_sizes_match`, and after a
# restore fell back past it, the next save kept it and deleted the good checkpoint the job had
# just restored from, leaving one good checkpoint where two are promised.
_rejected: dict[str, set[int]] = {}


def distrust(directory: str | os.PathLike, seq: int) -> None:
    """Remember that checkpoint `seq` in `directory` failed its size or sha256 check here."""
    _rejected.setdefault(os.path.realpath(directory), set()).add(seq)


def _prune(d: Path, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints of either format whose files have the sizes
    their manifests say, and what those manifests name; delete the other manifests, then every
    other data file up to the newest seq (older payloads and parts, damaged ones, and orphan parts
    a crash left before their manifest). Data files of a newer seq are a write in progress and are
    left alone. A damaged checkpoint does not count among the kept: after a restore fell back past
    a truncated one, the next save kept it and deleted the good one restored from; nor does one
    whose payload this process's restore found damaged (`distrust`), whatever its sizes."""
    committed = []
    for e in d.iterdir():
        if _MANIFEST.match(e.name):
            try:
                named = _manifest_files(fsutil.read_small_json(e, MAX_MANIFEST_BYTES))
            except (OSError, ValueError):
                named = None
            if named is not None and e.name == f"ckpt-{named[0]:06d}.json":
                committed.append(named)
    committed.sort(key=lambda x: x[0], reverse=True)
    newest = committed[0][0] if committed else 0
    bad = _rejected.get(os.path.realpath(d), set())
    kept = [(seq, files) for seq, files, sizes in committed if seq not in bad and _sizes_match(d, sizes)][:keep]
    live = {f"ckpt-{seq:06d}.json" for seq, _ in kept}
    live |= {f for _, files in kept for f in files}
    # Manifests first: a crash mid-prune must never leave a manifest pointing at a deleted payload.
    for e in sorted(d.iterdir(), key=lambda e: not e.name.endswith(".json")):
        m = re.match(r"^ckpt-(\d+)\.(pt|json|r\d+\.pt)$", e.name)
        if m and e.name not in live and int(m.group(1)) <= newest:
            _unlink(e)


def verify(directory: str | os.PathLike, info: CheckpointInfo) -> Path:
    """Check the payload's size and sha256 against the manifest; return its path. A payload that
    fails is damaged for good: the next save does not keep its checkpoint (`distrust`); one of
    another world size or format is not damaged, and is judged by age alone."""
    try:
        return _verify(Path(directory) / info.payload, info)
    except CheckpointError:
        distrust(directory, info.seq)
        raise


def _verify(path: Path, info: CheckpointInfo) -> Path:
    try:   # O_NONBLOCK: a FIFO under the payload's name is refused below, never waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"payload {path} missing: {exc}") from None
    sha = hashlib.sha256()
    with open(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):    # a device's size says nothing of what it reads
            raise CheckpointError(f"payload {path} is not a regular file")
        if st.st_size != info.bytes:
            raise CheckpointError(f"payload {path} has {st.st_size} bytes, manifest says {info.bytes}")
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    if sha.hexdigest() != info.sha256:
        raise CheckpointError(f"payload {path} fails its sha256 check")
    return path


def load_checkpoint(directory: str | os.PathLike, info: CheckpointInfo) -> dict[str, Any]:
    """Verify and load one checkpoint's payload (tensors on CPU)."""
    import torch

    path = verify(directory, info)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a verified file should load; be defensive anyway
        raise CheckpointError(f"payload {path} does not load: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"payload {path} is not a {FORMAT} payload")
    return payload


def find_latest(directory: str | os.PathLike) -> tuple[CheckpointInfo | None, dict[str, Any] | None, list[str]]:
    """(info, payload) of the newest checkpoint that verifies and loads (None, None if there is
    none), and one line per newer committed checkpoint that was unusable, newest first."""
    rejected: list[str] = []
    infos = list_checkpoints(directory, rejected)
    for n, info in enumerate(infos):
        try:
            payload = load_checkpoint(directory, info)
        except CheckpointError as exc:
            nxt = f"falling back to ckpt seq {infos[n + 1].seq}" if n + 1 < len(infos) else "no older checkpoint left"
            _warn(f"checkpoint seq {info.seq} (step {info.step}) is unusable: {exc}; {nxt}")
            rejected.append(f"seq {info.seq} (step {info.step}): {exc}")
            continue
        return info, payload, rejected
    return None, None, rejected


def load_latest(directory: str | os.PathLike) -> tuple[CheckpointInfo, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back (with a warning) past corrupt ones;
    None if none does. Restores go through `choose`, which refuses to start over silently."""
    info, payload, _ = find_latest(directory)
    return (info, payload) if info is not None and payload is not None else None


def choose(directory: str | os.PathLike, env: Mapping[str, str] = os.environ, job_id: str | None = None,
           ) -> tuple[CheckpointInfo | None, dict[str, Any] | None, str | None]:
    """What a (re)starting job restores: (info, payload, note).

    The newest good checkpoint; `note` says which newer ones were skipped and why. No checkpoint
    at all: (None, None, None), a fresh start. Checkpoints that exist but none usable: raises
    NoUsableCheckpoint, since starting over would silently throw the training away, unless the
    job's environment has GPUSWAP_RESTART_ON_BAD_CHECKPOINT=1; then (None, None, note) and the
    note says it restarts from step 0 and why. The newest good checkpoint written by another job
    than `job_id`: raises ForeignCheckpoint (`check_owner`).
    """
    info, payload, rejected = find_latest(directory)
    if info is not None:
        check_owner(info.job_id, job_id, info.seq, info.step, directory, env)
        note = (f"newer checkpoint(s) unusable, used seq {info.seq} (step {info.step}) instead: "
                + "; ".join(rejected)) if rejected else None
        return info, payload, note
    if not rejected:
        return None, None, None
    why = "no usable checkpoint: " + "; ".join(rejected)
    if env.get(RESTART_ON_BAD_CHECKPOINT, "").strip() == "1":
        return None, None, f"{why}; restarted from step 0 as {RESTART_ON_BAD_CHECKPOINT}=1 asks"
    raise NoUsableCheckpoint(f"{why}; not restarting from step 0 (set {RESTART_ON_BAD_CHECKPOINT}=1 in the "
                             "job's environment to allow that)")


def attach_of(payload: Mapping[str, Any]) -> int:
    """Which `attach()` of its process wrote a checkpoint (a single-rank payload, or a rank's part):
    1 for the first, 2 for the second, ... A script may attach several times (pretraining then
    fine-tuning, two `fit()` calls); after a restart only the attach of the same ordinal restores
    the checkpoint (`other_attach`). A checkpoint written before the ordinal was recorded counts as
    the first attach's, which is what it was in a script that attaches once."""
    n = payload.get("attach")
    return n if type(n) is int and n >= 1 else 1


def other_attach(written_by: int, attach_no: int, seq: int, step: Any) -> str | None:
    """None if attach number `attach_no` of this process is the one that restores a checkpoint
    `written_by` that attach; else the one line that says why it does not, and what happens
    instead (docs/runtime.md "Several attaches in one process")."""
    if written_by == attach_no:
        return None
    if attach_no < written_by:
        return (f"attach {attach_no} of this process does not restore checkpoint seq {seq} (step {step}): "
                f"attach {written_by} wrote it, after this phase had finished; this phase runs again from "
                f"step 0, and attach {written_by} resumes from the checkpoint")
    return (f"attach {attach_no} of this process starts from step 0: checkpoint seq {seq} (step {step}) was "
            f"written by attach {written_by}, which has finished since")


def _warn(text: str) -> None:
    print(f"gpuswap: {text}", file=sys.stderr, flush=True)
