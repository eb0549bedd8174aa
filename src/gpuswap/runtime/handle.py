"""The handle a training loop calls `safepoint(step)` on (`attach()`, in attaching.py, makes it).

The hot path is two attribute operations: record the step, test one flag the control thread
sets. Everything else (parking, checkpointing, waiting for resume, measuring the device memory
the attached tensors hold) runs in the training thread inside `safepoint`, so tensors are only
touched between steps, never concurrently with them. No other thread may even read a tensor's
`.grad` or storage: the autograd engine and optimizers change them without the GIL, and such a
read from another thread crashed training with SIGSEGV (issue 10). The usage heartbeat therefore
only asks for a measurement (the same flag) and reports what the last safepoint measured.

Pause state machine (guarded by one condition variable; the reader thread only flips flags):

    running --pause(ram|disk)--> [next safepoint] parking --ram--> parked --resume--> running
                                                         +--disk--> checkpoint, exit 75
    parked --pause(disk)--> spill: checkpoint from the host copies, exit 75
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.protocol import records
from gpuswap.runtime import simdevice
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.objects import Attached, iter_tensors

EXIT_WATCHDOG_S = 30.0


class NullJob:
    """The handle outside gpuswap: nothing is parked, nothing is restored. Plain values given to
    `attach` are in `state` under their names, as inside gpuswap before any checkpoint."""

    __slots__ = ("step", "state")
    start_step = 0
    parked = False
    inside = False

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.step: int | None = None
        self.state: dict[str, Any] = dict(state or {})

    def safepoint(self, step: int) -> None:
        self.step = step

    def close(self) -> None:
        pass


class Job:
    """The handle inside gpuswap. Construct through `attach`."""

    __slots__ = (
        "step", "state", "start_step", "restored_step", "restored_bytes", "restore_s", "config", "_items",
        "_pending", "_cond", "_phase", "_tier_req", "_resume_req", "_client", "_last_bytes", "_max_bytes",
        "_measure_req", "_owner", "restore_note", "_outside", "_serve_pause", "_before_exit", "attach_no",
        "checkpoint_of", "attach_sigs", "_expected", "_sim",
    )
    inside = True
    prepares_ahead = True   # host buffers prepared when a pause is asked (prefault.py); a rank's
                            # handle serves its pauses through its own cursor and does not

    def __init__(self, items: list[Attached], config: RuntimeConfig,
                 serve_pause: Callable[["Job", str], None] | None = None,
                 before_exit: Callable[[], None] | None = None) -> None:
        """`serve_pause(job, tier)`: what a pause does at the safepoint (`pausing.serve`; a rank's
        handle serves its own). `before_exit`: run before exit 75 (Slurm's requeue). `attach`
        gives both, so this module imports neither the park path nor Slurm's."""
        self.step: int | None = None
        self.state: dict[str, Any] = {}
        self.start_step = 0
        self.restored_step: int | None = None
        self.restored_bytes = 0                  # checkpoint bytes restored at attach, and how long
        self.restore_s: float | None = None      # it took: the daemon's disk-read bandwidth sample
        self.restore_note: str | None = None     # newer checkpoints skipped, or a requested restart
        self.attach_no = 1                       # which attach of the process made it (1, 2, ...; attaching.py)
        self.checkpoint_of: int | None = None    # the attach whose checkpoint this one found and left alone
        self.attach_sigs: tuple[str, ...] = ()   # objects.signature of the process's attaches up to this one
        self.config = config
        self._sim = config.simulated   # safepoint's one extra test (a slot, as `_pending`)
        self._items = items
        self._pending = False  # the one flag safepoint reads: a pause or a measurement is asked for
        self._cond = threading.Condition()
        self._phase = "running"  # running | parking | parked
        self._tier_req: str | None = None
        self._resume_req = False
        self._client: Any = None
        self._last_bytes = 0   # device bytes the attached tensors held when last measured
        self._expected: Any = None  # ... and their storage sizes (reach.Measured), for prefault.py
        self._measure_req = False
        self._owner = threading.get_ident()  # the training thread (the one that attached)
        self._max_bytes: int | None = None  # cap on a RAM park's bytes (the daemon's RAM budget)
        self._outside: int | None = None    # simulated GPUs: device bytes held outside the attached tensors
        self._serve_pause = serve_pause
        self._before_exit = before_exit

    # -- hot path --------------------------------------------------------------------------
    def safepoint(self, step: int) -> None:
        """Call after each completed step. Returns at once unless a pause (or, every few
        seconds, a measurement of device memory) was asked for."""
        if self._sim:
            simdevice.step()   # the step's CUDA calls: they block while the driver holds the process
        self.step = step
        if self._pending:
            self._serve()

    @property
    def parked(self) -> bool:
        return self._phase == "parked"

    @property
    def items(self) -> list[Attached]:
        """The attached objects, classified (what a park copies and a checkpoint holds)."""
        return self._items

    # -- requests (any thread) -------------------------------------------------------------
    def request_pause(self, tier: str = "ram", max_bytes: int | None = None) -> None:
        """Ask for a pause at the next safepoint (what a supervisor `pause` message does).
        `max_bytes`: a RAM park larger than this goes to disk instead (the host-RAM budget)."""
        if tier not in ("ram", "disk"):
            self.send(records.Error(message=f"unknown pause tier {tier!r}"))
            return
        with self._cond:
            if tier == "ram" and (self._phase != "running" or self._tier_req is not None):
                return  # already pausing or paused: a second ram pause changes nothing
            self._tier_req = tier
            self._max_bytes = max_bytes if tier == "ram" else None
            if self._phase == "running":
                self._prepare_ahead(tier, self._max_bytes)   # before the flag: the park finds it
                self._pending = True
            self._cond.notify_all()

    def request_resume(self) -> None:
        """Resume a parked job; cancels a pause that has not reached a safepoint yet."""
        with self._cond:
            if self._phase == "running":
                if self._tier_req is None:
                    return
                self._tier_req, self._pending = None, self._measure_req
                self._withdraw_ahead()
                cancelled = True
            else:
                self._resume_req = True
                self._cond.notify_all()
                cancelled = False
        if cancelled:
            self.send(records.Resumed(bytes=0, seconds=0.0))

    def pause_asked(self) -> str | None:
        """The tier of a pause asked for and not yet taken at a safepoint, if any."""
        with self._cond:
            return self._tier_req

    def request_measure(self) -> None:
        """Have the next safepoint measure `device_bytes` (what the usage heartbeat does)."""
        with self._cond:
            self._measure_req = True
            if self._phase == "running":
                self._pending = True

    def _prepare_ahead(self, tier: str, max_bytes: int | None) -> None:
        """Have the pool map, fault in and pin the park's host buffers while the step finishes
        (runtime/prefault.py). Only for a pause that will copy: a RAM pause over its cap with no
        checkpoint directory to go to fails instead, and so does a disk pause without one.
        Caller holds the lock, so the training thread cannot start the park before this."""
        expected = self._expected
        if not self.prepares_ahead or expected is None or not expected.sizes:
            return
        over = max_bytes is not None and sum(expected.sizes) > max_bytes
        if not self.config.ckpt_dir and (tier == "disk" or over):
            return
        from gpuswap.runtime import pinned, prefault

        if prefault.enabled():
            try:
                prefault.prepare(pinned.pool_for(self.config.simulated),
                                 prefault.Expected(expected.sizes, expected.device))
            except Exception as exc:   # never let a preparation stop the pause itself
                print(f"gpuswap: preparing host buffers failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)

    def _withdraw_ahead(self) -> None:
        """No park will take what `_prepare_ahead` made: back to the pool (idle, then released)."""
        if not self.prepares_ahead or self._expected is None:
            return
        from gpuswap.runtime import pinned, prefault

        prefault.withdraw(pinned.pool_for(self.config.simulated))

    def _on_message(self, msg: records.Order) -> None:
        if isinstance(msg, records.Pause):
            self.request_pause(msg.tier, msg.max_bytes)
        elif isinstance(msg, records.Resume):
            self.request_resume()

    # -- the slow path (training thread) ---------------------------------------------------
    def _serve(self) -> None:
        with self._cond:
            tier, self._tier_req = self._tier_req, None
            self._pending = self._resume_req = self._measure_req = False
            if tier is not None:
                self._phase = "parking"
        if tier is None:
            told = self._last_bytes
            if self.measure() != told:      # report a change now, not a heartbeat later: the
                self.send(self._usage_msg())    # policy sizes parks by it (a young job's optimizer
            return                              # state appears only at its first step)
        try:
            if self._serve_pause is not None:
                self._serve_pause(self, tier)
            else:   # a handle not made by `attach`: it has no park path
                self.send(records.Error(message=f"park to {tier} failed: no park path"))
        finally:
            self._withdraw_ahead()    # a park that took it has it; one that failed early did not
            with self._cond:
                if self._phase != "running":  # a failed park: drop what came in meanwhile
                    self._phase = "running"
                    self._tier_req, self._resume_req = None, False
                self._pending = self._tier_req is not None or self._measure_req
        self.measure()  # running again (resumed, or the park failed): what it holds now

    def take_ram_cap(self) -> int | None:
        """The cap on this RAM park's bytes that came with the pause (once: the next pause brings
        its own)."""
        with self._cond:
            cap, self._max_bytes = self._max_bytes, None
        return cap

    def mark_running(self) -> None:
        """Resumed: from now on a new pause request is served at the next safepoint."""
        with self._cond:
            self._phase = "running"

    def claim_device(self, nbytes: int) -> None:
        """Simulated GPUs, before a RAM park's bytes are copied back: the process holds them on its
        GPU again (with what the park kept), as parking.restore's refill would allocate them; a
        full GPU raises what torch's refill would (runtime/simdevice.py) and nothing is claimed."""
        simdevice.hold(nbytes + self._outside_bytes(), self.config.simulated)

    def mark_parked(self) -> None:
        # parked: a simulated GPU keeps the context floor and what the park cannot free
        simdevice.hold(self._outside_bytes(), self.config.simulated)
        with self._cond:
            self._phase = "parked"
            self._last_bytes = 0

    def wait_request(self) -> str:
        """Block while parked until 'resume' or 'disk' is asked for."""
        with self._cond:
            self._phase = "parked"
            while not self._resume_req and self._tier_req != "disk":
                self._cond.wait()
            if self._tier_req == "disk":
                self._tier_req = None
                return "disk"
            self._resume_req = False
            return "resume"

    # -- channel ---------------------------------------------------------------------------
    def send(self, msg: records.Report) -> bool:
        client = self._client
        return client.send(msg) if client is not None else False

    def device_bytes(self) -> int:
        """Device memory held by the attached tensors (0 while parked).

        Measured now when called from the thread that attached (the training thread, between
        steps); from any other thread, the value the last measurement found (at attach, at a
        pause or resume, or at the safepoint after the usage heartbeat asked): reading tensors
        while a step runs in another thread can crash the process."""
        if self.parked:
            return 0
        if threading.get_ident() == self._owner:
            return self.measure()
        return self._last_bytes

    def measure(self) -> int:
        """Walk the attached tensors. Training thread only (see the module docstring)."""
        from gpuswap.runtime.reach import measure

        try:
            found = measure(iter_tensors(self._items), self.config.simulated)
            self._last_bytes, self._expected = found.nbytes, found
        except RuntimeError:  # a container changed size under us (a thread of the user's): keep the last
            pass
        # simulated GPUs: what NVML would list
        simdevice.hold(self._last_bytes + self._outside_bytes(), self.config.simulated)
        return self._last_bytes

    def _outside_bytes(self) -> int:
        """Simulated GPUs only: device memory the process holds outside the attached tensors
        that the runtime knows of and a park leaves in place: the bucket buffers of a DDP
        (world size 1 here: a single-rank park keeps its Reducer; runtime/ddpreducer.py)."""
        if not self.config.simulated:
            return 0
        if self._outside is None:
            from gpuswap.runtime import ddpreducer
            from gpuswap.runtime.regroup import find_ddps

            ddps = [d() for d in find_ddps(self._items)]
            self._outside = sum(ddpreducer.held_bytes(d) for d in ddps if d is not None)
        return self._outside

    def _hello(self) -> records.Hello:
        # Sent from the reader thread: the last measurement, never a walk of the tensors.
        return records.Hello(pid=os.getpid(), device_bytes=0 if self.parked else self._last_bytes,
                             restored_step=self.restored_step, restored_bytes=self.restored_bytes,
                             restore_s=self.restore_s, restore_note=self.restore_note,
                             job_id=self.config.job_id, parked=self.parked)

    def _usage(self) -> records.Usage:
        """The heartbeat (usage thread): reports the last measurement and asks the next
        safepoint for a new one."""
        msg = self._usage_msg()
        if not msg.parked:
            self.request_measure()
        return msg

    def _usage_msg(self) -> records.Usage:
        """A usage report from what was last measured (any thread: allocator counters are safe)."""
        parked = self.parked
        reserved = None
        torch = sys.modules.get("torch")
        if torch is not None and not self.config.simulated and torch.cuda.is_available() \
                and torch.cuda.is_initialized():
            reserved = sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
        return records.Usage(device_bytes=0 if parked else self._last_bytes, step=self.step, parked=parked,
                             reserved_bytes=reserved)

    def connect(self, control: str) -> None:
        """Open the control channel (the supervisor's, or a coordinator's socket): its reader
        thread brings pause and resume, its usage thread sends the heartbeat."""
        from gpuswap.runtime.client import ControlClient

        self._client = ControlClient(control, self._on_message, self._hello, self._usage, self._progress())
        self._client.start()

    def _progress(self) -> Callable[[], int] | None:
        """What moves while this job writes a checkpoint, if anything waits on it (ranks.py)."""
        return None

    def close(self) -> None:
        """Stop the control threads (done at exit anyway; they are daemon threads)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        with self._cond:
            if self._phase == "running" and self._tier_req is not None:
                self._withdraw_ahead()   # a pause asked and never served: nothing will take it

    def exit_requeue(self) -> None:
        """Leave with REQUEUE_EXIT_CODE. SystemExit unwinds the job normally; a watchdog makes
        sure a stray non-daemon thread cannot keep the process alive."""
        self.close()
        if self._before_exit is not None:
            self._before_exit()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

        def _watchdog() -> None:
            time.sleep(EXIT_WATCHDOG_S)
            os._exit(REQUEUE_EXIT_CODE)

        threading.Thread(target=_watchdog, name="gpuswap-exit", daemon=True).start()
        raise SystemExit(REQUEUE_EXIT_CODE)
