"""A simulated CUDA device for machines without a GPU, as strict as the real driver observably is.

A process becomes a *simulated CUDA process* by calling `allocate(nbytes)` (a test job does, in
place of `torch.cuda`): it writes its own registration (pid, start time, GPU, bytes) into the
directory named by `GPUSWAP_SIM_CUDA_DIR`, which the daemon sets for every job on simulated GPUs.
Nobody tells the daemon which pid that is: it finds it as it would on a real node, in the
simulated NVML process list (`SimulatedGpus.list()`), which may name a child or grandchild of the
launched command. The daemon's simulated checkpoint driver (node/simdriver.py) records where the
driver has put each process in `driver/PID.json`; a process checkpointed there holds no device
memory and is absent from the process list, as on a real GPU (docs/transparent.md lists each
behaviour and its source).

Layout of the state directory (the daemon's `simulated-driver/`):
  procs/PID.json   a registration, written by the process itself (sticky, world-writable dir:
                   each user's processes register themselves; nobody can replace another's file)
  driver/PID.json  the driver's state for that process, written by the daemon only (readable by
                   name, as any user can ask NVML and the driver about a pid; not listable)
A registration counts only while its process lives with the recorded start time and runs as the
file's owner: a reused pid or another user's forged file is ignored.
"""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuswap.fsutil import atomic_write_json
from gpuswap.protocol.env import SIM_CUDA_DIR

MAX_BYTES = 2**53
RESIDENT = ("running", "locked")       # driver states in which a process holds device memory


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (immune to pid reuse), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def stopped(pid: int) -> bool:
    """True if the process is stopped by a signal (state T)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        return stat[stat.rindex(")") + 2] in "Tt"
    except (OSError, ValueError, IndexError):
        return False


@dataclass(frozen=True)
class Registration:
    pid: int
    start: int          # start_ticks when it registered
    gpu: int            # the GPU it allocated on (CUDA_VISIBLE_DEVICES' first entry)
    nbytes: int
    busy: bool = False  # a kernel that never finishes: a lock waits for it and times out


class SimDevice:
    """The registry both sides share: processes' registrations and the driver's record of them."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.procs, self.driver_dir = self.root / "procs", self.root / "driver"

    def prepare(self) -> None:
        """Make the directories (daemon side, at start)."""
        from gpuswap.fsutil import make_dir

        make_dir(self.root, 0o711)
        make_dir(self.procs, 0o1733)       # like /tmp, but not listable by users
        make_dir(self.driver_dir, 0o711)   # a job reads its own state by name (its CUDA calls block on
                                           # it); nobody lists whose processes the driver holds

    # -- registrations ----------------------------------------------------------------------
    def registration(self, pid: int) -> Optional[Registration]:
        """pid's registration if it is a living simulated CUDA process (whatever its driver state)."""
        path = self.procs / f"{int(pid)}.json"
        try:   # a user's entry: never follow a link or wait on a FIFO planted under that name
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            owner, raw = st.st_uid, os.read(fd, 4096)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            d = json.loads(raw)
            reg = Registration(int(d["pid"]), int(d["start"]), int(d["gpu"]), int(d["nbytes"]), bool(d.get("busy")))
        except (ValueError, KeyError, TypeError):
            return None
        if reg.pid != pid or not 0 <= reg.nbytes <= MAX_BYTES or not 0 <= reg.gpu < 1024:
            return None
        if start_ticks(pid) != reg.start or _uid(pid) != owner:
            return None              # the process is gone (its pid maybe reused), or a forgery
        return reg

    def registrations(self) -> list[Registration]:
        """Every living simulated CUDA process; registrations of dead ones are removed."""
        out = []
        try:
            names = os.listdir(self.procs)
        except OSError:
            return []
        for name in names:
            if not name.endswith(".json") or not name[:-5].isdigit():
                continue
            reg = self.registration(int(name[:-5]))
            if reg is not None:
                out.append(reg)
            elif start_ticks(int(name[:-5])) is None:
                for stale in (self.procs / name, self.driver_dir / name):
                    try:
                        stale.unlink()
                    except OSError:
                        pass
        return sorted(out, key=lambda r: r.pid)

    # -- the driver's record ------------------------------------------------------------------
    def driver_record(self, reg: Registration) -> dict:
        """{'state', 'gpu', 'poisoned'} as the simulated driver left this process (running on its
        own GPU if the driver never touched it; a record of an earlier process with this pid is void)."""
        try:
            d = json.loads((self.driver_dir / f"{reg.pid}.json").read_text())
            if d.get("start") == reg.start:
                return {"state": str(d["state"]), "gpu": int(d["gpu"]), "poisoned": bool(d.get("poisoned"))}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return {"state": "running", "gpu": reg.gpu, "poisoned": False}

    def set_driver_record(self, reg: Registration, state: str, gpu: int, poisoned: bool = False) -> None:
        from gpuswap.fsutil import atomic_write_json

        atomic_write_json(self.driver_dir / f"{reg.pid}.json",
                          {"start": reg.start, "state": state, "gpu": gpu, "poisoned": poisoned}, 0o644)

    def resident(self) -> list[tuple[int, int, int]]:
        """(pid, gpu, bytes) of every process holding device memory now: what NVML would list."""
        out = []
        for reg in self.registrations():
            rec = self.driver_record(reg)
            if rec["state"] in RESIDENT:
                out.append((reg.pid, rec["gpu"], reg.nbytes))
        return out

    def gpus_in_use(self) -> set[int]:
        """GPUs any living simulated CUDA process is on or was checkpointed from."""
        return {self.driver_record(r)["gpu"] for r in self.registrations()}


def _uid(pid: int) -> Optional[int]:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


# -- the job's side: what a CUDA program does -------------------------------------------------
def allocate(nbytes: int, busy: bool = False, device: int = 0) -> Registration:
    """Become a simulated CUDA process holding `nbytes` on CUDA device `device` (an ordinal within
    CUDA_VISIBLE_DEVICES, as with cudaSetDevice). One GPU per process: a job on several GPUs runs
    one such process per GPU. `busy`: a kernel that does not finish until the process registers
    again without it, so a lock waits for it (and times out).

    A CUDA call like any other: while the driver holds this process (locked or checkpointed) it
    blocks before touching the registration, as `sync` does, so a frozen process registers nothing
    until it is thawed (CUDA docs, cuCheckpointProcessLock: "block further CUDA API calls")."""
    root = os.environ.get(SIM_CUDA_DIR)
    if not root:
        raise RuntimeError(f"{SIM_CUDA_DIR} is not set: not a job on simulated GPUs")
    sync()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[device].strip()
    reg = Registration(os.getpid(), start_ticks(os.getpid()) or 0, int(visible), int(nbytes), busy)
    path = Path(root) / "procs" / f"{reg.pid}.json"
    atomic_write_json(path, reg.__dict__, 0o644)    # the daemon reads it (simulated NVML's process list)
    return reg


def sync(poll_s: float = 0.02) -> None:
    """A CUDA call: blocks while the driver holds this process locked or checkpointed (as real CUDA
    calls do: CUDA docs, cuCheckpointProcessLock, "block further CUDA API calls"; cuda-checkpoint
    README, CPU threads calling CUDA "may block until CUDA is resumed"), and for good once a failed
    restore left it stuck. A process that never registered is no CUDA process: nothing blocks it."""
    root = os.environ.get(SIM_CUDA_DIR)
    if not root:
        return
    dev = SimDevice(Path(root))
    me = dev.registration(os.getpid())
    while me is not None and dev.driver_record(me)["state"] != "running":
        time.sleep(poll_s)
