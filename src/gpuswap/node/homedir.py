"""The daemon's home made private at every start, whatever the umask it runs under.

Other users must reach the API socket (the CLI) and, for their own jobs, their `output.log`,
`ckpt/` and control socket; nothing else. So every directory is the daemon's and 0711 (others may
traverse, never list) or 0700, every file 0600, and what a job's owner may use is theirs
(launcher.py). A home written by an older version (0644 database, 0755 checkpoint directories) is
tightened here; one the daemon cannot make private is refused with one line.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Optional

from gpuswap.fsutil import make_dir, make_file

# The API socket's path must fit sun_path (107 bytes and a NUL).
SUN_PATH_MAX = 107
DIR_MODE = 0o711
_HOME_FILES = ("state.db", "state.db-wal", "state.db-shm", "state.db-journal", "daemon.lock", ".calibration")


class HomeError(Exception):
    """Why the home cannot be used, in one line."""


def prepare(home: Path) -> None:
    """Create or tighten the home and everything the daemon keeps at its top level."""
    sock = home / "gpuswap.sock"
    if len(os.fsencode(str(sock.absolute()))) > SUN_PATH_MAX:
        raise HomeError(f"the path of {home} is too long for its API socket ({sock}: Unix socket paths "
                        f"hold at most {SUN_PATH_MAX} bytes); choose a shorter GPUSWAP_HOME")
    home.mkdir(parents=True, exist_ok=True)
    st = os.stat(home)
    if st.st_uid != os.geteuid():
        raise HomeError(f"{home} belongs to uid {st.st_uid}, not to the daemon's user (uid {os.geteuid()}): "
                        "its owner could read or replace every job's files; use a directory the daemon's user owns")
    make_dir(home, DIR_MODE)
    make_dir(home / "jobs", DIR_MODE)
    for name in _HOME_FILES:
        _private_file(home / name, 0o600)
    make_file(home / "state.db", 0o600)    # before SQLite makes it (and its -wal, -shm: same mode)
    if (home / "simulated-driver").is_dir():
        _private_tree(home / "simulated-driver")


Owner = Callable[[int], Optional[tuple[int, int]]]


def tighten_jobs(home: Path, owner: Owner) -> int:
    """Set the modes launcher.py gives every job directory, for directories an older version made.
    `owner(job_id)` is the job's (uid, gid), or None for a directory with no job record (it becomes
    the daemon's alone). Returns how many job directories were looked at."""
    jobs = home / "jobs"
    count = 0
    root = os.geteuid() == 0
    for entry in os.scandir(jobs):
        if not entry.name.isdigit() or not entry.is_dir(follow_symlinks=False):
            continue
        count += 1
        job_dir = Path(entry.path)
        ids = owner(int(entry.name)) if root else None
        uid, gid = ids if ids is not None else (-1, -1)
        make_dir(job_dir, DIR_MODE)
        for sub in os.scandir(job_dir):
            path = Path(sub.path)
            if sub.is_symlink():
                continue
            if sub.name == "ckpt" and sub.is_dir():
                make_dir(path, 0o700, uid, gid)        # the job writes there, as its owner
            elif sub.name == "output.log" and sub.is_file():
                make_file(path, 0o600, uid, gid)
            elif sub.is_dir():
                make_dir(path, DIR_MODE)               # a run directory: holds the control socket
                for f in os.scandir(path):
                    if f.is_file(follow_symlinks=False):
                        _chmod_if_there(f.path, 0o600)
            elif sub.is_file():
                _chmod_if_there(path, 0o600)
    return count


def _chmod_if_there(path: str | Path, mode: int) -> None:
    """chmod a run file a live supervisor may rename away meanwhile: its atomic writes' temporary
    files come and go (`fsutil`), and a restart at that instant must not fail for one."""
    try:
        os.chmod(path, mode)
    except FileNotFoundError:
        pass


def _private_file(path: Path, mode: int) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        os.chmod(path, mode)


def _private_tree(top: Path) -> None:
    make_dir(top, 0o700)
    for entry in os.scandir(top):
        if entry.is_file(follow_symlinks=False):
            os.chmod(entry.path, 0o600)
