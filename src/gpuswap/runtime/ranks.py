"""A rank of a multi-rank job (torchrun, accelerate, Slurm tasks): who it is, and its handle.

Every rank attaches to the same gpuswap job and talks to the supervisor's coordinator over its
own connection (`runtime/agreement.py` is the protocol, `rankcursor.py` this rank's side of it).
The handle differs from the single-rank one in three ways only:

* `safepoint` counts ticks (safepoint calls since attach), which the agreement compares across
  ranks; one increment on the hot path.
* the reader thread feeds every control message into the cursor, under the job's lock, setting
  the pause flag *before* reading the tick (the ordering the common step relies on);
* the training thread, at a flagged safepoint, carries out what the cursor says: wait, park
  (destroy the groups, then today's single-process park), unpark, regroup, release.

The disk tier of a multi-rank job (each rank writes its part, rank 0 a manifest) is not built
here: `write_part` is its seam, and until it is filled a disk park is refused with the reason.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gpuswap.runtime import parking, pausing, simdevice
from gpuswap.runtime.handle import Job, RuntimeConfig
from gpuswap.runtime.objects import Attached
from gpuswap.runtime.rankcursor import (COMMIT, CONTINUE, EXIT, PARK, REGROUP, RELEASE, UNPARK, WAIT, WRITE,
                                        RankCursor)
from gpuswap.runtime.regroup import Regroup

MAX_WORLD = 1024     # what the supervisor accepts (node/messages.py)

DISK_NOT_BUILT = "disk parking of multi-rank jobs is not supported yet"


@dataclass(frozen=True)
class RankIdentity:
    rank: int
    world_size: int
    local_rank: int


def identity(env: Mapping[str, str] = os.environ, group: Optional[tuple[int, int]] = None) -> RankIdentity:
    """From torchrun/accelerate (RANK, WORLD_SIZE, LOCAL_RANK); else from `group`, the (rank, world
    size) of the initialized default process group (Lightning's plain-script launch sets WORLD_SIZE
    and LOCAL_RANK but no RANK, and mp.spawn sets none: the group is the truth there); else Slurm
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); else a single rank. Values that make no sense give
    a single rank with one line to stderr: the job trains on, only not as a pausable multi-rank job."""
    found: list[tuple[str, Any, Any, Any]] = []       # (where, rank, world size, local rank)
    if "RANK" in env and "WORLD_SIZE" in env:
        found.append(("RANK/WORLD_SIZE", env["RANK"], env["WORLD_SIZE"], env.get("LOCAL_RANK", "0")))
    if group is not None and group[1] > 1:
        found.append(("the default process group", group[0], group[1],
                      env.get("LOCAL_RANK", env.get("SLURM_LOCALID", group[0]))))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        found.append(("SLURM_PROCID/SLURM_NTASKS", env["SLURM_PROCID"], env["SLURM_NTASKS"],
                      env.get("SLURM_LOCALID", "0")))
    if not found:
        return RankIdentity(0, 1, 0)
    where, rank_s, world_s, local_s = found[0]
    try:
        rank, world, local = int(rank_s), int(world_s), int(local_s)
    except ValueError:
        rank, world, local = -1, 0, 0
    if 1 <= world <= MAX_WORLD and 0 <= rank < world and local >= 0:
        return RankIdentity(rank, world, local)
    print(f"gpuswap: ignoring {where} = {rank_s!r}/{world_s!r}: not a rank of a world of 1..{MAX_WORLD}; "
          "this process attaches as a single-rank job", file=sys.stderr, flush=True)
    return RankIdentity(0, 1, 0)


def default_group() -> Optional[tuple[int, int]]:
    """(rank, world size) of the job's initialized default process group, if it has one. Never
    imports torch: a job that did not import torch.distributed has no group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except (RuntimeError, ValueError, AttributeError):
        pass
    return None


class RankJob(Job):
    """The handle of one rank. Construct through `gpuswap.attach`."""

    __slots__ = ("tick", "rank", "world_size", "local_rank", "_cursor", "_regroup", "_park", "_ram_refusal",
                 "_done")

    def __init__(self, items: list[Attached], config: RuntimeConfig, who: RankIdentity) -> None:
        super().__init__(items, config)
        simdevice.bind(who.local_rank)
        self.tick = 0
        self.rank, self.world_size, self.local_rank = who.rank, who.world_size, who.local_rank
        self._cursor = RankCursor()
        self._regroup = Regroup(items)
        self._park: Optional[parking.RamPark] = None
        self._ram_refusal = self._regroup.refusal()
        self._done = False

    # -- hot path --------------------------------------------------------------------------
    def safepoint(self, step: int) -> None:
        self.step = step
        self.tick = t = self.tick + 1      # stored before the flag is tested (rankcursor.py)
        if self._pending:
            self._serve_tick(t)

    # -- reader thread ---------------------------------------------------------------------
    def _on_message(self, msg: dict[str, Any]) -> None:
        with self._cond:
            if msg.get("op") == "pause":
                self._pending = True       # the flag first, then the tick: a bound of where we stop
            out = self._cursor.on_message(msg, self.tick)
            self._pending = self._cursor.flagged or self._measure_req
            self._cond.notify_all()
        for m in out:
            self._send(m)

    def request_measure(self) -> None:
        with self._cond:
            self._measure_req = True
            self._pending = True

    # -- training thread -------------------------------------------------------------------
    def _serve_tick(self, tick: int) -> None:
        with self._cond:
            measure, self._measure_req = self._measure_req, False
            action, out = self._cursor.at_safepoint(tick)
            self._pending = self._cursor.flagged
        self._send_all(out)
        if action == CONTINUE:
            if measure:
                told = self._last_bytes
                if self._measure() != told:
                    self._send(self._usage_msg())
            return
        while action != CONTINUE:
            if action == WAIT:
                with self._cond:
                    while True:
                        action, out = self._cursor.wake()
                        if action != WAIT or out:
                            break
                        self._cond.wait()
                    # A holding rank released by a target beyond its tick trains on *flagged*: its
                    # next safepoints must come back here to stop at the target.
                    self._pending = self._cursor.flagged or self._measure_req
                self._send_all(out)
                continue
            ok, info = self._carry_out(action)
            with self._cond:
                out = self._cursor.finished(action, ok, info)
                running = self._cursor.phase == "running"
                self._pending = self._cursor.flagged or self._measure_req
            self._send_all(out)
            action = CONTINUE if running else WAIT
        self._measure()

    def _carry_out(self, action: str) -> tuple[bool, dict[str, Any]]:
        """One instruction of the cursor; (ok, what to report). Never raises: a failure is
        reported and the coordinator decides (resume everyone, keep parked, or end the job)."""
        t0 = time.perf_counter()
        try:
            if action == PARK:
                return True, self._do_park(t0)
            if action == UNPARK:
                if self._park is not None:
                    parking.restore(self._park, self.config.simulated)   # host copies kept until regroup
                self._phase = "running"
                self._measure()
                return True, {"bytes": self._park.nbytes if self._park else 0,
                              "seconds": round(time.perf_counter() - t0, 6)}
            if action == REGROUP:
                if self._cursor.rebuild:
                    self._regroup.rebuild(int(self._cursor.epoch or 0))
                if self._park is not None:
                    parking.drop_host(self._park)
                nbytes = self._park.nbytes if self._park else 0
                self._park = None
                return True, {"bytes": nbytes, "seconds": round(time.perf_counter() - t0, 6)}
            if action == RELEASE:
                if self._park is not None and not self._park.released:
                    parking.release(self._park, self.config.simulated)
                self._mark_parked()
                return True, {}
            if action == WRITE:
                return True, write_part(self)
            if action in (COMMIT, EXIT):
                raise RuntimeError(DISK_NOT_BUILT)
            raise RuntimeError(f"unknown action {action!r}")
        except Exception as exc:
            text = f"{action} failed: {type(exc).__name__}: {exc}"
            print(f"gpuswap: rank {self.rank}: {text}", file=sys.stderr, flush=True)
            return False, {"message": text}

    def _do_park(self, t0: float) -> dict[str, Any]:
        refusal = self._regroup.refusal()
        if refusal:
            raise parking.ParkRefused(refusal, disk_ok=True)
        self._regroup.teardown()
        park, _ = pausing._park(self, "ram", want_payload=False)
        self._park = park
        self._mark_parked()
        return {"bytes": park.nbytes, "seconds": round(time.perf_counter() - t0, 6), "step": self.step}

    def _mark_parked(self) -> None:
        simdevice.hold(0, self.config.simulated)
        self._phase = "parked"
        self._last_bytes = 0

    def _send_all(self, msgs: list[dict[str, Any]]) -> None:
        for m in msgs:
            self._send(m)

    # -- channel ---------------------------------------------------------------------------
    def _hello(self) -> dict[str, Any]:
        msg = super()._hello()
        with self._cond:
            phase, epoch = self._cursor.phase, self._cursor.epoch
        msg.update(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                   state=phase, epoch=epoch, ram_refusal=self._ram_refusal)
        return msg

    def close(self) -> None:
        """This rank is done training: the job is no longer pausable (an attempt in progress is
        withdrawn), then the channel closes. Also run at exit (`attach` registers it)."""
        if not self._done:
            self._done = True
            self._send({"op": "done", "step": self.step})
        super().close()


def write_part(job: RankJob) -> dict[str, Any]:
    """The disk tier's seam: write this rank's part of a multi-rank checkpoint and return what
    `part{...}` reports (file, bytes, sha256, seconds). Not built yet: raising here makes the
    coordinator resume every rank (nothing was torn down for a disk park)."""
    raise RuntimeError(DISK_NOT_BUILT)


def restore_ranks(job: RankJob) -> None:
    """The disk tier's other seam: at attach, restore this rank from the newest committed
    multi-rank checkpoint. No multi-rank checkpoint is ever written yet, so there is none to read;
    a single-rank checkpoint in the directory is not this job's format and is left alone."""
    return None
