"""Atomic small-file writes (temp file in the same directory, fsync, rename, fsync the directory)
and files and directories made with exactly the mode and owner asked, whatever the umask.

A reader sees the old content or the new, never a torn file, whatever instant a process dies.
Modes are set with fchmod/chmod after creation: the umask only ever removes bits, and a mode
that depends on the caller's umask is not a mode anyone chose.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PRIVATE = 0o600     # the default for every file the daemon writes: its own, or its job owner's


def atomic_write_bytes(path: Path | str, data: bytes, mode: int = PRIVATE) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)          # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
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


def atomic_write_json(path: Path | str, obj: Any, mode: int = PRIVATE) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode(), mode)


def read_json(path: Path | str) -> Any:
    """The file's JSON, or None if it is absent (never half-written: writers are atomic)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


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
