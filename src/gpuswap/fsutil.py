"""Atomic small-file writes (temp file in the same directory, fsync, rename, fsync the directory)
and files and directories made with exactly the mode and owner asked, whatever the umask; and
bounded reads of small files someone else may have planted.

A reader sees the old content or the new, never a torn file, whatever instant a process dies.
Modes are set with fchmod/chmod after creation: the umask only ever removes bits, and a mode
that depends on the caller's umask is not a mode anyone chose.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Callable

PRIVATE = 0o600     # the default for every file the daemon writes: its own, or its job owner's


def temp_path(path: Path) -> Path:
    """Where `atomic_write` puts `path` while writing it: a hidden `.NAME.PID.tmp` beside it (a
    writer killed mid-way leaves one; `is_temp` tells them apart for whoever cleans up)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def atomic_write(path: Path | str, write: Callable[[BinaryIO], Any], mode: int = PRIVATE) -> None:
    """`write(f)` fills a temp file, which is fsynced and renamed over `path`; then the directory
    is fsynced. The one atomic-write routine: small files, JSON and streamed checkpoints alike."""
    path = Path(path)
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)          # whatever the umask
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A failed write (a full disk) leaves the old file as it was and no temp file behind.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def atomic_write_bytes(path: Path | str, data: bytes, mode: int = PRIVATE) -> None:
    atomic_write(path, lambda f: f.write(data), mode)


def atomic_write_json(path: Path | str, obj: Any, mode: int = PRIVATE) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), mode)


def read_json(path: Path | str) -> Any:
    """The file's JSON, or None if it is absent (never half-written: writers are atomic)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def read_small(name: Path | str, limit: int, dir_fd: int | None = None) -> bytes:
    """The bytes of `name`, which must be a regular file of at most `limit` bytes; OSError says
    why not. For files whose owner is not to be trusted to have made them well (a job's checkpoint
    directory is the job owner's to fill, by hand or by accident): a link is never followed
    (O_NOFOLLOW: not to /dev/zero, not to someone else's file), a FIFO or device never waited on
    (O_NONBLOCK, then only a regular file is read), and no more than `limit` + 1 bytes are read,
    whatever the file's size says or becomes."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{os.fspath(name)} is not a regular file")
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise OSError(f"{os.fspath(name)} is larger than {limit} bytes")
    return b"".join(chunks)


def read_small_json(name: Path | str, limit: int, dir_fd: int | None = None) -> Any:
    """`read_small`'s file as JSON. OSError: unreadable (see `read_small`); ValueError: not JSON,
    not UTF-8, or nested too deep to parse (json raises RecursionError for that, which a caller
    catching parse errors would not expect)."""
    raw = read_small(name, limit, dir_fd)
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def make_dir(path: Path | str, mode: int, uid: int = -1, gid: int = -1) -> None:
    """`path` as a directory (never through a symlink) with exactly `mode`, owned by uid:gid
    (-1: unchanged)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_file(path: Path | str, mode: int, uid: int = -1, gid: int = -1) -> None:
    """`path` as a file (created empty if absent, never through a symlink) with exactly `mode`,
    owned by uid:gid (-1: unchanged)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
