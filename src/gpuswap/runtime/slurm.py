"""Slurm-aware preemption for the in-job runtime (no gpuswap daemon needed).

Under Slurm (`$SLURM_JOB_ID` set, `$GPUSWAP_JOB_ID` not) `attach` turns the runtime on by
itself: checkpoints go to `$GPUSWAP_CKPT_DIR`, else `$SLURM_SUBMIT_DIR/.gpuswap/ckpt/$SLURM_JOB_ID`
(the job id is stable across requeues, so a restarted job finds its own checkpoints).

Slurm's preemption signals (default USR2 and TERM; `$GPUSWAP_SLURM_SIGNALS`) become a disk pause
at the next safepoint. The signal handler does no I/O and takes no lock: it writes one byte to a
pipe, and a helper thread turns that into `request_pause("disk")` (Lightning issue #21406 shows
what writing a checkpoint inside a handler does). USR1 is left alone by default: NCCL uses it.

After the checkpoint is durable the job requeues itself with `scontrol requeue $SLURM_JOB_ID`
(`$GPUSWAP_SLURM_REQUEUE=scontrol`, the default) and exits with REQUEUE_EXIT_CODE (75); with
`$GPUSWAP_SLURM_REQUEUE=exit` it only exits 75 and leaves the requeue to Slurm
(`RequeueExit=75`, or PreemptMode=REQUEUE finishing the preemption).

A multi-rank job (torchrun under `gpuswap slurm-wrap`, or `srun --ntasks N`) stops every rank at
one step through the in-job coordinator (`slurmcoord.py`): under `slurm-wrap` the wrapper serves
it and gets the signal itself (its `$GPUSWAP_CONTROL` reaches every rank); otherwise rank 0 serves
it on a thread and each rank's signal asks it for the pause. The coordinator's owner, not the
ranks, requeues the job once every part and the manifest are written.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gpuswap.protocol import env as envvars
from gpuswap.protocol.env import JobEnv
from gpuswap.protocol.records import Preempt
from gpuswap.runtime.config import RuntimeConfig

if TYPE_CHECKING:
    from gpuswap.runtime.handle import Job

DEFAULT_SIGNALS = "USR2,TERM"
# Raised by the fault itself: a Python handler only sets a flag and returns to the faulting
# instruction, which faults again forever (the process spins instead of dying).
FAULT_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
REQUEUE_TIMEOUT_S = 20.0
REQUEUE_FROM = ("RUNNING", "SUSPENDED")  # job states in which a checkpointed job asks for requeue


def detect(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a Slurm job, unless `$GPUSWAP_SLURM=0`."""
    return bool(env.get("SLURM_JOB_ID")) and env.get(envvars.SLURM, "1") not in ("0", "")


def default_ckpt_dir(env: Mapping[str, str] = os.environ) -> str:
    base = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
    return str(Path(base) / ".gpuswap" / "ckpt" / env["SLURM_JOB_ID"])


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    try:
        return int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def config_from_env(env: Mapping[str, str] = os.environ) -> "RuntimeConfig | None":
    """The runtime's configuration for a Slurm job, or None outside Slurm (and for a multi-rank
    job that cannot be coordinated: it trains on as outside gpuswap, with one line saying why)."""
    if not detect(env):
        return None
    control = None
    from gpuswap.runtime.ranks import identity

    who = identity(env)
    if who.world_size > 1:
        control = coordinator_address(who, env)
        if control is None:
            return None
    given = JobEnv.from_env(env)
    return RuntimeConfig(
        job_id=env["SLURM_JOB_ID"],
        control=control,
        ckpt_dir=given.ckpt_dir or default_ckpt_dir(env),
        simulated=given.simulated,
        slurm=True,
    )


def wrapped(env: Mapping[str, str] = os.environ) -> bool:
    """`gpuswap slurm-wrap` serves the coordinator (and gets the signals): it set $GPUSWAP_CONTROL."""
    return bool(env.get(envvars.CONTROL))


def coordinator_address(who: Any, env: Mapping[str, str] = os.environ) -> str | None:
    """Where a rank of a multi-rank Slurm job finds the coordinator: the wrapper's socket, else the
    one rank 0 serves in the job's private directory (every rank checks that directory is ours,
    creating it if it is the first). None, with the reason on stderr, if it cannot be coordinated."""
    from gpuswap.runtime import slurmcoord

    why = slurmcoord.why_not(env)
    if why is None and wrapped(env):
        return env[envvars.CONTROL]
    if why is None:
        try:
            step = env.get("SLURM_STEP_ID") or "batch"
            return str(slurmcoord.private_dir(env) / f"step-{step}.sock")
        except OSError as exc:
            why = f"no private directory for the coordinator's socket ({exc})"
    print(f"gpuswap: rank {who.rank} of {who.world_size}: {why}; a preemption will not checkpoint this "
          "job (it trains on as outside gpuswap)", file=sys.stderr, flush=True)
    return None


_server: Any = None            # the coordinator this process serves (rank 0 of an srun-form job)
_requeues_here = True          # False in a rank whose coordinator's owner requeues the job


def coordinate(config: "RuntimeConfig", who: Any, env: Mapping[str, str] = os.environ) -> None:
    """Before a rank of a multi-rank Slurm job connects: rank 0 of an srun-form job starts the
    coordinator on a thread (once per process), and requeues the job after it commits."""
    global _server, _requeues_here
    _requeues_here = False
    if wrapped(env) or who.rank != 0 or _server is not None or config.control is None:
        return
    from pathlib import Path

    from gpuswap.runtime import slurmcoord

    def on_kill(reason: str) -> None:
        print(f"gpuswap: ending the job: {reason}", file=sys.stderr, flush=True)
        server.kill_ranks(but=os.getpid())
        os._exit(1)

    server = slurmcoord.CoordServer(Path(config.control), slurmcoord.timeout_s(env), on_kill)
    try:
        server.start()
    except OSError as exc:
        print(f"gpuswap: rank 0 cannot serve the coordinator at {config.control} ({exc}); "
              "a preemption will not checkpoint this job", file=sys.stderr, flush=True)
        return
    _server = server
    done = threading.Thread(target=_requeue_after_commit, args=(server, config, env), name="gpuswap-requeue",
                            daemon=True)
    done.start()
    import atexit

    def finish() -> None:      # rank 0 exits right after the commit: let the requeue finish first
        # The `exit` can reach this rank before the server's thread has set `committed` (it sends
        # the exit, then checks): the coordinator's phase already says checkpointed then.
        if server.committed.is_set() or server.table.coord.phase == "checkpointed":
            server.committed.wait(REQUEUE_TIMEOUT_S)
            done.join(REQUEUE_TIMEOUT_S * 2)

    atexit.register(finish)


def _requeue_after_commit(server: Any, config: "RuntimeConfig", env: Mapping[str, str]) -> None:
    server.committed.wait()
    requeue(config, env, owner=True)


def parse_signals(text: str, source: str = envvars.SLURM_SIGNALS) -> list[signal.Signals]:
    """"USR2,TERM" / "SIGUSR2 15" -> signals; "none" or "" -> []. `source` (where the text came
    from) starts any error message."""
    out: list[signal.Signals] = []
    for word in text.replace(",", " ").split():
        if word.lower() == "none":
            return []
        name = word.upper()
        try:
            sig = signal.Signals(int(name)) if name.isdigit() else \
                signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except (KeyError, ValueError):
            raise ValueError(f"{source}: unknown signal {word!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{source}: {sig.name} cannot be caught")
        if sig in FAULT_SIGNALS:
            raise ValueError(f"{source}: {sig.name} reports a fault, it is no preemption signal")
        if sig not in out:
            out.append(sig)
    return out


def signals_from_env(env: Mapping[str, str] = os.environ) -> list[signal.Signals]:
    """`$GPUSWAP_SLURM_SIGNALS`, or the default; a value that is no signal list is ignored with one
    line on stderr (the job is already training: a typo must not end it with a traceback)."""
    try:
        return parse_signals(env.get(envvars.SLURM_SIGNALS, DEFAULT_SIGNALS))
    except ValueError as exc:
        print(f"gpuswap: ignoring {exc}; using {DEFAULT_SIGNALS}", file=sys.stderr, flush=True)
        return parse_signals(DEFAULT_SIGNALS)


class SignalBridge:
    """Signal -> one byte on a pipe -> helper thread -> `job.request_pause("disk")`.

    The handler runs between bytecodes of the training thread, possibly while it holds the
    job's lock; so it only writes to the pipe, and the lock is taken by the helper thread.
    A signal caught before there is a job (during `attach`'s restore, `catch_early`) is kept
    in a list instead and acted on by `deliver_to` in the attaching thread, so the checkpoint
    is taken at the job's first safepoint whatever the helper thread's scheduling.

    Each attach after the first begins with `detach`: from then on a signal waits for the new
    job too, and a checkpoint asked of the previous job and never taken (a signal after its last
    safepoint: between two phases, or two `fit()` calls) is asked of the new one. Before, both
    went to the previous job, whose loop had ended: the checkpoint was never taken.
    """

    def __init__(self, job: "Job | None", signals: list[signal.Signals]) -> None:
        self.job = job
        self.signals = signals
        self.received: list[str] = []
        self._early: list[int] = []          # caught before `deliver_to` named the job
        self._carried: str | None = None     # a signal the previous job never took a checkpoint for
        self._lock = threading.Lock()        # the pump against `detach`/`deliver_to`; never the handler
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous: dict[signal.Signals, Any] = {}
        self._thread = threading.Thread(target=self._pump, name="gpuswap-slurm", daemon=True)

    def detach(self) -> None:
        """A new attach begins (`catch_early`): what is caught from here on waits for its job."""
        with self._lock:
            old, self.job = self.job, None
            if old is not None and getattr(old, "world_size", 1) <= 1 and old.pause_asked() == "disk" \
                    and self.received:
                self._carried = self.received[-1]

    def deliver_to(self, job: "Job") -> None:
        """Name the job; what was caught before it existed is asked for now, before `attach`
        returns. The job is set first: a signal from here on goes through the pipe."""
        with self._lock:
            self.job = job
            early, self._early = self._early, []
            carried, self._carried = self._carried, None
        if carried is not None and not early:
            print(f"gpuswap: the checkpoint asked for by {carried} before this attach was not taken; "
                  "taking it at this attach's first safepoint", file=sys.stderr, flush=True)
            job.request_pause("disk")
        for signum in early:
            self._act(signum)

    def install(self) -> None:
        """Make the handler ours for every signal whose handler is not; start the pump once.

        Called on every attach, not just the first: a framework may have put its own (or the
        default) handlers back in between, as Lightning's signal teardown does at the end of
        each `fit()`, and a second fit's signals must still reach the new job."""
        for sig in self.signals:
            if signal.getsignal(sig) != self._handler:
                self._previous[sig] = signal.signal(sig, self._handler)
        if self._thread.ident is None:
            self._thread.start()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.job is None:        # no job yet: `deliver_to` acts on it (list.append is atomic)
            self._early.append(signum)
            return
        try:
            os.write(self._w, bytes([signum & 0xFF]))
        except OSError:  # pipe full: a pause is already on its way
            pass

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                self._act(signum)

    def _act(self, signum: int) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            job = self.job
            if job is None:         # written before `detach`, read after: for the coming job
                self._early.append(signum)
                return
            self.received.append(name)
            rank = getattr(job, "world_size", 1) > 1
            if not rank:
                job.request_pause("disk")   # under the lock: `detach` sees it asked, or the new job gets it
        print(f"gpuswap: got {name} from Slurm; checkpointing at the next safepoint",
              file=sys.stderr, flush=True)
        if rank and not job.send(Preempt(signal=name)):     # a rank: ask the coordinator
            print("gpuswap: the job's coordinator is not reachable; this rank cannot ask for "
                  "the checkpoint", file=sys.stderr, flush=True)


_bridge: SignalBridge | None = None


def catch_early(who: Any, env: Mapping[str, str] = os.environ) -> None:
    """Take Slurm's signals before `attach` restores a checkpoint, which can take a while for a
    large one: a signal then (a time limit's `--signal=USR2@120`, a second preemption) used to meet
    the default action and end the job unrequeued, with nothing saved. Caught here, it waits in
    the pipe until `install` names the job, which then checkpoints at its first safepoint. Not for
    a rank under `slurm-wrap` (the wrapper gets the signals) nor off the main thread (`install`
    says so)."""
    global _bridge
    if (who is not None and who.world_size > 1 and wrapped(env)) \
            or threading.current_thread() is not threading.main_thread():
        return
    try:
        signals = parse_signals(env.get(envvars.SLURM_SIGNALS, DEFAULT_SIGNALS))
    except ValueError:      # `install` reports the bad list once, and uses these too
        signals = parse_signals(DEFAULT_SIGNALS)
    if _bridge is None:
        _bridge = SignalBridge(None, signals)
    else:
        _bridge.detach()    # a later attach: the previous job's loop has ended
    _bridge.install()


def install(job: "Job", env: Mapping[str, str] = os.environ) -> SignalBridge | None:
    """Route Slurm's preemption signals to a disk pause; called by `attach` under Slurm."""
    global _bridge
    signals = signals_from_env(env)
    restarts = restart_count(env)
    rank = getattr(job, "world_size", 1) > 1
    by_wrapper = rank and wrapped(env)   # slurm-wrap gets the signals and coordinates the ranks
    who = f"rank {getattr(job, 'rank', 0)} of {getattr(job, 'world_size', 1)}; " if rank else ""
    print(f"gpuswap: Slurm job {job.config.job_id} (restart {restarts}); {who}checkpoints in "
          f"{job.config.ckpt_dir}; preemption signals "
          f"{'handled by gpuswap slurm-wrap' if by_wrapper else ','.join(s.name for s in signals) or 'none'}",
          file=sys.stderr, flush=True)
    if restarts and job.restored_step is None and job.checkpoint_of is None:
        print("gpuswap: restarted by Slurm but no usable checkpoint: starting from step 0",
              file=sys.stderr, flush=True)
    if by_wrapper:
        return None
    if _bridge is not None:  # caught early (`catch_early`), or a second attach: one pipe and pump
        _bridge.deliver_to(job)
    if threading.current_thread() is not threading.main_thread():
        print("gpuswap: attach() not called from the main thread: Slurm signals not handled",
              file=sys.stderr, flush=True)
        return None
    if _bridge is None:
        _bridge = SignalBridge(job, signals)
    _bridge.install()  # also takes back handlers that were replaced since the last attach
    return _bridge


def job_state(job_id: str) -> str | None:
    """JobState as slurmctld sees it (RUNNING, CANCELLED, ...), or None if it cannot be asked."""
    try:
        res = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                             text=True, timeout=REQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for word in res.stdout.split():
        if word.startswith("JobState="):
            return word.partition("=")[2]
    return None


def requeue(config: "RuntimeConfig", env: Mapping[str, str] = os.environ, owner: bool = False) -> bool:
    """After a durable checkpoint: ask Slurm to requeue this job (unless told to leave it to
    Slurm). Returns whether `scontrol requeue` succeeded. A rank of a multi-rank job leaves this
    to the coordinator's owner (`owner=True`), so the job is requeued once."""
    if env.get(envvars.SLURM_REQUEUE, "scontrol") == "exit" or not (owner or _requeues_here):
        return False
    job_id = env.get("SLURM_JOB_ID") or config.job_id
    state = job_state(str(job_id))
    if state is not None and state not in REQUEUE_FROM:
        # scancel also sends SIGTERM: a cancelled job must stay cancelled
        print(f"gpuswap: Slurm job {job_id} is {state}; not requeueing it", file=sys.stderr, flush=True)
        return False
    try:
        res = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True,
                             text=True, timeout=REQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"gpuswap: scontrol requeue {job_id} failed: {exc}; exiting 75 "
              "(configure RequeueExit=75 to requeue anyway)", file=sys.stderr, flush=True)
        return False
    if res.returncode != 0:
        print(f"gpuswap: scontrol requeue {job_id}: {res.stderr.strip() or res.returncode}",
              file=sys.stderr, flush=True)
        return False
    print(f"gpuswap: requeued Slurm job {job_id}", file=sys.stderr, flush=True)
    return True
