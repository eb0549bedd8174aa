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

The disk tier (docs/design/multi-rank.md section 4): at `park{disk}` each rank writes its part of
the checkpoint (`write_part`: from the device, or from the host copies when it spills from RAM),
rank 0 commits the manifest at `commit` (`commit_parts`), every rank exits 75 at `exit`; at the
next start every rank restores from the newest committed checkpoint (`restore_ranks`).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional

from gpuswap.protocol import records
from gpuswap.runtime import checkpoint, ckparts, objects, parking, rankstate, simdevice
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.handle import Job
from gpuswap.runtime.objects import Attached
from gpuswap.runtime.rankcursor import (COMMIT, CONTINUE, EXIT, PARK, REGROUP, RELEASE, UNPARK, WAIT, WRITE,
                                        RankCursor)
from gpuswap.runtime.regroup import Regroup, _holders

MAX_WORLD = 1024     # what the supervisor accepts (protocol/messages.py)


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

    prepares_ahead = False   # its park follows the ranks' agreement, not `request_pause`
    __slots__ = ("tick", "rank", "world_size", "local_rank", "_cursor", "_regroup", "_park", "_ram_refusal",
                 "_done", "restored_seq", "_payload")

    def __init__(self, items: list[Attached], config: RuntimeConfig, who: RankIdentity,
                 before_exit: Optional[Callable[[], None]] = None) -> None:
        super().__init__(items, config, before_exit=before_exit)   # it serves its own pauses
        simdevice.bind(who.local_rank)
        self.tick = 0
        self.rank, self.world_size, self.local_rank = who.rank, who.world_size, who.local_rank
        self._cursor = RankCursor()
        self._regroup = Regroup(items)
        self._park: Optional[parking.RamPark] = None
        self._ram_refusal = self._regroup.refusal()
        self._done = False
        self.restored_seq: Optional[int] = None
        self._payload: Optional[dict[str, Any]] = None   # the part a spill writes, taken at the RAM park

    # -- hot path --------------------------------------------------------------------------
    def safepoint(self, step: int) -> None:
        if self._sim:
            simdevice.step()   # the step's CUDA calls: they block while the driver holds the process
        self.step = step
        self.tick = t = self.tick + 1      # stored before the flag is tested (rankcursor.py)
        if self._pending:
            self._serve_tick(t)

    # -- reader thread ---------------------------------------------------------------------
    def _on_message(self, msg: records.Order) -> None:
        with self._cond:
            if isinstance(msg, records.Pause):
                self._pending = True       # the flag first, then the tick: a bound of where we stop
            out = self._cursor.on_message(msg, self.tick)
            self._pending = self._cursor.flagged or self._measure_req
            self._cond.notify_all()
        for m in out:
            self.send(m)

    def request_measure(self) -> None:
        with self._cond:
            self._measure_req = True
            self._pending = True

    def _usage_msg(self) -> records.Usage:
        """The heartbeat, with the bytes this process has written to checkpoint files: while its
        part is being written (the training thread is inside the write) they show the coordinator
        that the disk park moves (agreement.py `poll`)."""
        msg = super()._usage_msg()
        written = checkpoint.bytes_written()
        return replace(msg, written=written) if written else msg

    def _progress(self) -> Callable[[], int]:
        """The coordinator waits on a part being written as long as its bytes keep growing."""
        return checkpoint.bytes_written

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
                if self.measure() != told:
                    self.send(self._usage_msg())
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
        self.measure()

    def _carry_out(self, action: str) -> tuple[bool, dict[str, Any]]:
        """One instruction of the cursor; (ok, what to report). Never raises: a failure is
        reported and the coordinator decides (resume everyone, keep parked, or end the job)."""
        t0 = time.perf_counter()
        try:
            if action == PARK:
                return True, self._do_park(t0)
            if action == UNPARK:
                if self._park is not None:
                    if self.config.simulated and self._park.released:
                        self.claim_device(self._park.nbytes)      # a full simulated GPU fails here
                    parking.restore(self._park, self.config.simulated)   # host copies kept until regroup
                    self._regroup.build_reducers()    # DDP's bucket buffers: memory back, or fail here
                self._phase = "running"
                self.measure()
                return True, {"bytes": self._park.nbytes if self._park else 0,
                              "seconds": round(time.perf_counter() - t0, 6)}
            if action == REGROUP:
                rebuilt = self._cursor.rebuild and self._regroup.rebuild(int(self._cursor.epoch or 0))
                group_s = time.perf_counter() - t0
                if self._park is not None:
                    parking.drop_host(self._park)
                nbytes = self._park.nbytes if self._park else 0
                self._park, self._payload = None, None
                info = {"bytes": nbytes, "seconds": round(time.perf_counter() - t0, 6)}
                if rebuilt:
                    info["group_s"] = round(group_s, 6)   # the daemon learns group_rebuild_s from it
                return True, info
            if action == RELEASE:
                if self._park is not None and not self._park.released:
                    parking.release(self._park, self.config.simulated)
                if self._park is not None:
                    self._free_buckets()              # those an unpark made again
                self.mark_parked()
                return True, {}
            if action == WRITE:
                return True, write_part(self)
            if action == COMMIT:
                return True, commit_parts(self, self._cursor.parts)
            if action == EXIT:
                self._done = True            # not `done`: the job is checkpointed, not finished
                if self._park is not None:   # a spill: its freed tensors leave on the host, whole
                    try:
                        parking.leave_on_host(self._park, objects.iter_tensors(self.items))
                    except Exception as exc:
                        print(f"gpuswap: rank {self.rank}: moving parked tensors to the host failed: {exc}",
                              file=sys.stderr, flush=True)
                self.exit_requeue()          # SystemExit: not caught below
            raise RuntimeError(f"unknown action {action!r}")
        except Exception as exc:
            text = f"{action} failed: {type(exc).__name__}: {exc}"
            print(f"gpuswap: rank {self.rank}: {text}", file=sys.stderr, flush=True)
            return False, {"message": text}

    def _do_park(self, t0: float) -> dict[str, Any]:
        refusal = self._regroup.refusal()
        if refusal:
            raise parking.ParkRefused(refusal, disk_ok=True)
        t_group = time.perf_counter()
        had_group = self._regroup.teardown()
        group_s = time.perf_counter() - t_group
        park = parking.copy_to_host(objects.iter_tensors(self._items), self.config.simulated, "ram")
        try:
            # Taken now, as views of the host copies, for a spill: once released, a tensor parked
            # by pointing it at a placeholder (a storage torch cannot resize, e.g. one torch.load
            # made at a restore) has no host view any more.
            self._payload = part_payload(self, park) if self.config.ckpt_dir else None
            parking.release(park, self.config.simulated)
        except BaseException:
            parking.drop_host(park)
            raise
        self._park = park
        self._free_buckets()
        self.mark_parked()
        out = {"bytes": park.nbytes, "seconds": round(time.perf_counter() - t0, 6), "step": self.step}
        if had_group:
            out["group_s"] = round(group_s, 6)       # the daemon learns group_teardown_s from it
        return out

    def _free_buckets(self) -> None:
        """DDP's bucket buffers, which the park of the attached tensors cannot reach: drop the
        Reducers that hold them (runtime/ddpreducer.py; their layout is read here, after the
        release, so the zeros it reads it with fit in any GPU) and give the memory back."""
        if self._regroup.drop_reducers():
            parking.empty_device_cache(self.config.simulated)

    def _outside_bytes(self) -> int:
        """Simulated GPUs: the bucket buffers of every DDP whose Reducer exists now (all of them
        while running; while parked, those a park keeps: runtime/ddpreducer.py `keeps`)."""
        if not self.config.simulated:
            return 0
        return self._regroup.reducers.held(self._regroup.live_ddps())

    def mark_parked(self) -> None:
        simdevice.hold(self._outside_bytes(), self.config.simulated)
        self._phase = "parked"
        self._last_bytes = 0

    def _send_all(self, msgs: list[records.Report]) -> None:
        """Training thread only. Before `ready`: what this rank holds now, measured at the common
        step, which the coordinator decides the park's tier by (the RAM budget). The last report
        may be older than the first step, which makes the optimizer's state and the gradients."""
        if any(isinstance(m, records.Ready) for m in msgs):
            self.measure()
            self.send(self._usage_msg())
        for m in msgs:
            self.send(m)

    # -- channel ---------------------------------------------------------------------------
    def _hello(self) -> records.Hello:
        with self._cond:
            phase, epoch = self._cursor.phase, self._cursor.epoch
        return replace(super()._hello(), rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                       state=phase, epoch=epoch, ram_refusal=self._ram_refusal, restored_seq=self.restored_seq)

    def close(self) -> None:
        """This rank is done training: the job is no longer pausable (an attempt in progress is
        withdrawn), then the channel closes. Also run at exit (`attach` registers it)."""
        if not self._done:
            self._done = True
            self.send(records.Done(step=self.step))
        super().close()


def related(items: list[Attached]) -> list[Any]:
    """The DDP wrappers the job did not attach (a script may attach the module inside one): their
    replicated parameters go into rank 0's part once, and their bucket layout into every part."""
    attached = {id(a.obj) for a in items}
    return [w for w in rankstate.ddp_wrappers(_holders(items)) if id(w) not in attached]


def write_part(job: RankJob) -> dict[str, Any]:
    """At `park{disk}`, in the training thread at the common tick: write this rank's part and
    return what `part{...}` reports (file, bytes, sha256, seconds). From running the state is
    copied off the device (nothing is released: a failed write leaves the job as it was); a spill
    from RAM reads the parked host copies and touches neither the device nor the group."""
    cfg = job.config
    if not cfg.ckpt_dir:
        raise RuntimeError("no $GPUSWAP_CKPT_DIR for this job")
    payload = job._payload if job._park is not None else None
    if payload is None:
        if job._park is not None:
            raise RuntimeError("no checkpoint payload was taken at the RAM park")
        payload = part_payload(job, None)
    report = ckparts.write_part(cfg.ckpt_dir, payload)
    report.pop("rank", None)        # the supervisor knows which rank this connection is
    return report


def part_payload(job: RankJob, park: Optional[parking.RamPark]) -> dict[str, Any]:
    """This rank's part (rankstate.py): from `park`'s host copies, else copied off the device."""

    def to_host(t: Any) -> Any:
        view = park.host_view(t) if park is not None else None
        return view if view is not None else t.detach().cpu()

    return rankstate.part_payload(job.items, job.state, rank=job.rank, world_size=job.world_size,
                                  step=job.step, tick=job.tick, job_id=job.config.job_id, to_host=to_host,
                                  related=related(job.items), attach=job.attach_no)


def commit_parts(job: RankJob, parts: tuple[records.PartRef, ...]) -> dict[str, Any]:
    """Rank 0 at `commit{parts}`: write the manifest that makes every part one checkpoint; what
    `committed{...}` reports."""
    cfg = job.config
    if not cfg.ckpt_dir:
        raise RuntimeError("no $GPUSWAP_CKPT_DIR for this job")
    info = ckparts.write_manifest(cfg.ckpt_dir, [records.wire(p) for p in parts], step=job.step, tick=job.tick,
                                  world_size=job.world_size, job_id=cfg.job_id, attach=job.attach_no)
    return {"seq": info.seq, "path": os.path.join(cfg.ckpt_dir, info.manifest), "bytes": info.bytes,
            "step": info.step}


def restore_ranks(job: RankJob) -> None:
    """At attach, before the first forward: restore this rank from the newest committed
    multi-rank checkpoint (every rank verifies every part, so all choose the same one; the
    supervisor checks `restored_seq` all the same). None usable: `restore_failed`, exit 1."""
    cfg = job.config
    if not cfg.ckpt_dir:
        return
    done = rankstate.restore_latest(cfg.ckpt_dir, cfg.control, job.items, job.state, job.rank,
                                    job.world_size, related(job.items), cfg.job_id, job.attach_no)
    job.restore_note, job.checkpoint_of = done.note, done.checkpoint_of
    if done.step is None:
        return
    job.restored_step, job.start_step, job.restored_seq = done.step, done.start_step, done.seq
    job.restored_bytes, job.restore_s = done.bytes, done.seconds
