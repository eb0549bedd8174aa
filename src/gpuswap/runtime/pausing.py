"""What happens inside `safepoint` once a pause is asked for, and the restore at `attach`.

Both tiers start the same way: copy device state to host, snapshot everything a checkpoint
needs (as views of the host copies, so no second copy). A ram pause then frees the device
memory and waits for resume; a disk pause keeps it (`_park` says why), writes the snapshot and
exits with REQUEUE_EXIT_CODE, and so does a disk pause that arrives while parked in ram (a
spill). A failure anywhere is reported as an `error` message and the job runs on (or,
mid-spill, stays parked in ram).
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn

from gpuswap.protocol import records
from gpuswap.runtime import checkpoint, objects, parking, rng

if TYPE_CHECKING:
    from gpuswap.runtime.config import RuntimeConfig
    from gpuswap.runtime.handle import Job


def snapshot(job: "Job", park: parking.RamPark | None) -> dict[str, Any]:
    """The checkpoint payload; parked tensors become views of their host copies."""

    def to_host(t: Any) -> Any:
        view = park.host_view(t) if park is not None else None
        return view if view is not None else t.detach().cpu()

    return {
        "format": checkpoint.FORMAT,
        "step": job.step,
        "objects": objects.capture(job.items, to_host),
        "user_state": objects.map_tensors(job.state, to_host),
        "rng": rng.capture(),
        "job_id": job.config.job_id,
        "attach": job.attach_no,
        "attaches": list(job.attach_sigs),
    }


def _error(job: "Job", what: str, exc: BaseException) -> None:
    text = f"{what} failed: {type(exc).__name__}: {exc}"
    print(f"gpuswap: {text}", file=sys.stderr, flush=True)
    job.send(records.Error(message=text))


def _park(job: "Job", tier: str, want_payload: bool) -> tuple[parking.RamPark, dict[str, Any] | None]:
    """Host copies of the attached state, and its checkpoint payload if asked. A RAM park then
    frees the device memory; a disk park keeps it: the process exits once the checkpoint is
    written, and what runs while it unwinds (Lightning's teardown moves the optimizer's state to
    the CPU, a `finally:` may read the model) must find its tensors whole. On an H100 a freed one
    made that teardown fail with "CUDA error: invalid argument" and the exit code 1, not 75."""
    park = parking.copy_to_host(objects.iter_tensors(job.items), job.config.simulated, tier)
    try:
        payload = snapshot(job, park) if want_payload else None
        if tier == "ram":
            parking.release(park, job.config.simulated)
    except BaseException:
        parking.drop_host(park)
        raise
    return park, payload


def _spill(job: "Job", payload: dict[str, Any], note: str | None = None,
           released: parking.RamPark | None = None) -> Exception:
    """Write the checkpoint and exit 75; returns (the error) only if writing failed. `note`: why
    a RAM pause became this disk park (the daemon's event says it). `released`: the RAM park this
    spills, whose freed tensors leave on the host (`parking.leave_on_host`) before the exit."""
    t0 = time.perf_counter()
    try:
        info = checkpoint.write_checkpoint(job.config.ckpt_dir, payload, job.step, job.config.job_id)
    except Exception as exc:
        return exc
    job.send(records.Checkpointed(path=os.path.join(job.config.ckpt_dir, info.payload), bytes=info.bytes,
                                  seconds=round(time.perf_counter() - t0, 6), step=job.step, note=note or None))
    if released is not None:
        try:
            parking.leave_on_host(released, objects.iter_tensors(job.items))
        except Exception as exc:          # the checkpoint is committed: leave anyway
            print(f"gpuswap: moving parked tensors to the host before exit failed: {exc}", file=sys.stderr, flush=True)
    job.exit_requeue()
    raise AssertionError("unreachable")


def serve(job: "Job", tier: str) -> None:
    """Handle one pause request at the current safepoint.

    Every report goes out after the state it announces is in effect, so a supervisor reacting
    to it at once (e.g. a new pause right after an `error`) is never ignored.
    """
    if tier == "disk" and not job.config.ckpt_dir:
        job.mark_running()
        _error(job, "disk pause", RuntimeError("no $GPUSWAP_CKPT_DIR for this job"))
        return
    cap = job.take_ram_cap()
    held = job.measure() if tier == "ram" and cap is not None else None
    note = None
    if held is not None and held > cap:
        if not job.config.ckpt_dir:
            job.mark_running()
            _error(job, "park to ram", RuntimeError(f"{held} bytes exceed the RAM budget's {cap}"))
            return
        note = f"{held} bytes exceed the host-RAM budget's {cap}"
        print(f"gpuswap: {note}: parking to disk instead", file=sys.stderr, flush=True)
        tier = "disk"
    t0 = time.perf_counter()
    try:
        try:
            park, payload = _park(job, tier, want_payload=bool(job.config.ckpt_dir))
        except parking.ParkRefused as refused:   # e.g. a CUDA graph: addresses must not change
            if tier != "ram" or not refused.disk_ok or not job.config.ckpt_dir:
                raise
            note = f"RAM park refused: {refused}"
            print(f"gpuswap: {note}; parking to disk instead", file=sys.stderr, flush=True)
            tier = "disk"
            park, payload = _park(job, tier, want_payload=True)
    except Exception as exc:
        job.mark_running()
        _error(job, f"park to {tier}", exc)
        return
    if tier == "disk":
        exc = _spill(job, payload, note)  # exits on success
        if _unpark_or_report(job, park):  # the checkpoint failed: run on from the host copies
            job.mark_running()
            _error(job, "disk checkpoint", exc)
            return
        _error(job, "disk checkpoint", exc)
        # not even the device memory came back: stay parked in ram until told otherwise
    job.mark_parked()
    job.send(records.Paused(tier="ram", bytes=park.nbytes, seconds=round(time.perf_counter() - t0, 6),
                            step=job.step))
    while True:
        if job.wait_request() == "disk":
            _error(job, "disk checkpoint", _spill(job, payload, released=park))  # on failure stay parked
            continue
        t1 = time.perf_counter()
        if _unpark_or_report(job, park):
            job.mark_running()
            job.measure()  # its device memory is back (a simulated GPU lists it) before it says so
            job.send(records.Resumed(bytes=park.nbytes, seconds=round(time.perf_counter() - t1, 6)))
            return


def _unpark_or_report(job: "Job", park: parking.RamPark) -> bool:
    """Bring the park back; False (reported, still parked) if the device memory cannot be had: a
    full GPU, simulated ones included (the claim is their refill: runtime/simdevice.py)."""
    claimed = False
    try:
        if job.config.simulated and park.released:
            job.claim_device(park.nbytes)
            claimed = True
        parking.restore(park, job.config.simulated)
    except Exception as exc:
        if claimed:
            job.mark_parked()        # the refill gave its memory back: the park's floor again
        _error(job, "resume from ram", exc)
        return False
    parking.drop_host(park)
    return True


def restore_latest(job: "Job") -> None:
    """At attach: restore the newest good checkpoint in place, if there is one. The time it took
    (read, verify, load, copy into the objects) goes to the daemon with `hello`: it is what a
    disk-tier resume costs, the sample the daemon's disk-read bandwidth is learned from.
    Checkpoints that exist but none usable end the job (see `checkpoint.choose`). A checkpoint
    written by another attach of the process (a script that attaches once per phase) is left to
    that attach, and this one starts from step 0 (`checkpoint.other_attach` says why, once)."""
    t0 = time.perf_counter()
    info, payload = choose_or_exit(job.config)
    job.restore_note = _last_note
    if info is None or payload is None:
        return
    written_by = checkpoint.attach_of(payload)
    other = checkpoint.other_attach(written_by, job.attach_no, info.seq, info.step)
    if other is not None and skipped_to(job, payload, written_by):
        print(f"gpuswap: attach {job.attach_no} of this process is attach {written_by} of the run that wrote "
              f"checkpoint seq {info.seq} (step {info.step}): the phases before it were not run again; "
              "resuming it", file=sys.stderr, flush=True)
        job.attach_no, job.attach_sigs = written_by, tuple(payload["attaches"][:written_by])
        other = None
    if other is not None:
        print(f"gpuswap: {other}", file=sys.stderr, flush=True)
        job.checkpoint_of = written_by
        job.restore_note = "; ".join(filter(None, [_last_note, other]))
        return
    try:
        warnings = objects.restore(job.items, payload["objects"])
        warnings += rng.restore(payload["rng"])
    except Exception as exc:   # another model, another shape: neither a traceback nor a half-restored job
        _cannot_resume(job.config, f"checkpoint seq {info.seq} (step {info.step}) does not fit the attached "
                                   f"objects: {type(exc).__name__}: {' '.join(str(exc).split())}")
    job.state.clear()
    job.state.update(payload.get("user_state") or {})
    job.restored_step = int(payload["step"]) if payload.get("step") is not None else None
    job.start_step = job.restored_step + 1 if job.restored_step is not None else 0
    job.restored_bytes, job.restore_s = info.bytes, round(time.perf_counter() - t0, 6)
    for w in warnings:
        print(f"gpuswap: {w}", file=sys.stderr, flush=True)
    print(f"gpuswap: restored checkpoint seq {info.seq} (step {info.step}); "
          f"resuming at step {job.start_step}", file=sys.stderr, flush=True)


def skipped_to(job: "Job", payload: dict[str, Any], written_by: int) -> bool:
    """Whether this attach is the checkpoint's, come earlier because the script skipped phases
    that had finished (`if not os.path.exists(pretrained): pretrain()`): it attaches what the
    checkpoint's attach did, and nothing else that process attached did (objects.signature).
    Where an earlier phase attached alike, nothing tells the two apart: the phase runs again
    (docs/runtime.md "Several attaches in one process")."""
    sigs = payload.get("attaches")
    if job.attach_no >= written_by or not job.attach_sigs or not isinstance(sigs, list) \
            or len(sigs) < written_by or not all(isinstance(x, str) for x in sigs):
        return False
    mine = job.attach_sigs[-1]
    return sigs[written_by - 1] == mine and mine not in sigs[:written_by - 1]


_last_note: str | None = None


def _cannot_resume(config: "RuntimeConfig", why: str) -> NoReturn:
    """One line on stderr, `restore_failed` to the supervisor (if any), exit 1: a job that cannot
    resume its checkpoint must neither start over silently nor train on from a half restore."""
    text = f"cannot resume: {why}"
    print(f"gpuswap: {text}", file=sys.stderr, flush=True)
    if config.control:
        from gpuswap.runtime.client import send_once

        send_once(config.control, records.RestoreFailed(message=text[:2000]))
    raise SystemExit(1) from None


def choose_or_exit(config: "RuntimeConfig") -> tuple[Any, Any]:
    """`checkpoint.choose` for this job; the note (fallback or restart) is printed and kept for
    `hello`. If no checkpoint is usable and no restart was asked for, the supervisor is told why
    (`restore_failed`) and the process exits 1: a silent restart from step 0 would look like
    a resume. Used by `attach` and by the Lightning/Hugging Face callbacks before it."""
    global _last_note
    try:
        info, payload, note = checkpoint.choose(config.ckpt_dir, job_id=config.job_id)
    except checkpoint.NoUsableCheckpoint as exc:
        _cannot_resume(config, str(exc))
    if note:
        print(f"gpuswap: {note}", file=sys.stderr, flush=True)
    _last_note = note
    return info, payload
