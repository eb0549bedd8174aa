"""`gpuswap slurm-wrap -- CMD ...`: Slurm signal handling for jobs that do not import gpuswap.

    #SBATCH --signal=B:USR2@120
    exec gpuswap slurm-wrap -- python train.py

`--signal=B:...` signals only the batch shell, so a plain `python train.py` under bash would
never see it. The wrapper runs CMD as its child and, on each of the signals (default USR2 and
TERM), forwards the signal to the child (a child that uses `gpuswap.attach` then checkpoints at
its next safepoint and exits 75). With `--park` and the CUDA driver's checkpoint API available
(`gpuswap.node.cuda_ckpt`), the child is instead parked transparently: its device memory is
moved to host RAM and the GPU freed; SIGCONT (Slurm's resume after a SUSPEND preemption)
restores it. The wrapper exits with the child's exit code, or 128+N if a signal N killed it,
as a shell would, so Slurm's ExitCode and RequeueExit see what the child did.

Multi-rank jobs (`exec gpuswap slurm-wrap -- torchrun --nproc-per-node N train.py`): the wrapper
also serves the in-job coordinator (`runtime/slurmcoord.py`) on a socket in a private directory
and gives its address to CMD (`$GPUSWAP_CONTROL`), so every rank attaches to it. Once ranks have
attached, a signal is not forwarded (torchrun's agent dies of SIGUSR2): it becomes a disk pause
of every rank at a common step. After the checkpoint is committed the wrapper lets the launcher
end, requeues the job (`scontrol requeue`) and exits 75 itself, whatever the launcher's code:
torchrun turns a rank's exit 75 into SIGTERMs to the others and exit 1.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Optional

from gpuswap.exitcodes import EX_NOEXEC, EX_NOTFOUND, EX_USAGE
from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.protocol import env as envvars
from gpuswap.runtime.slurm import DEFAULT_SIGNALS, parse_signals

LAUNCHER_GRACE_S = 60.0   # after the commit: the ranks exit 75, torchrun stops the rest (its own 30 s)


def register(sub: Any) -> None:
    """Add the `slurm-wrap` verb to the gpuswap command line."""
    from gpuswap.cli.helptext import SLURM_ENVIRONMENT

    s = sub.add_parser("slurm-wrap", help="run CMD under Slurm, forwarding preemption signals: "
                                          "gpuswap slurm-wrap [--signals USR2,TERM] -- CMD ...",
                       description=__doc__, epilog=SLURM_ENVIRONMENT)
    s.add_argument("--signals", help=f"signals to forward (default ${envvars.SLURM_SIGNALS}, else {DEFAULT_SIGNALS}; "
                                     "'none' for none)")
    s.add_argument("--park", action="store_true",
                   help="park the child's GPU memory transparently instead of forwarding, where the "
                        "CUDA checkpoint API is available (else forward)")
    s.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    s.set_defaults(func=cmd_slurm_wrap)


def exit_code(returncode: int) -> int:
    """subprocess returncode -> shell-style exit status (a signal N becomes 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


def _transparent() -> Optional[Any]:
    """The real CUDA checkpoint driver, or None (with the reason on stderr)."""
    try:
        from gpuswap.node import cuda_ckpt

        version: Optional[str] = None
        try:
            import pynvml

            pynvml.nvmlInit()
            version = pynvml.nvmlSystemGetDriverVersion()
            version = version.decode() if isinstance(version, bytes) else version
        except Exception:
            pass
        cap = cuda_ckpt.detect({}, version)
        if cap.available:
            return cuda_ckpt.CudaCheckpointDriver(cap)
        reason = cap.reason
    except Exception as exc:  # the module or the driver is not there
        reason = f"{type(exc).__name__}: {exc}"
    print(f"gpuswap slurm-wrap: no transparent parking ({reason}); forwarding signals",
          file=sys.stderr, flush=True)
    return None


class Wrapper:
    """Child process + signal routing. Handlers only record; the main thread acts."""

    def __init__(self, cmd: list[str], signals: list[signal.Signals], driver: Optional[Any],
                 coord: Optional[Any] = None) -> None:
        self.cmd, self.signals, self.driver = cmd, signals, driver
        self.coord = coord        # slurmcoord.CoordServer: the ranks of a multi-rank CMD attach to it
        self.child: Optional[subprocess.Popen[bytes]] = None
        self.parked = False
        self._lock = threading.Lock()

    def _on_signal(self, signum: int, frame: Any) -> None:
        threading.Thread(target=self._act, args=(signum,), daemon=True).start()

    def _act(self, signum: int) -> None:
        with self._lock:                 # held by run() until the child exists, so no signal is lost
            child = self.child
            if child is None or child.poll() is not None:
                return
            if signum == signal.SIGCONT:
                if self.parked and self.driver is not None:
                    self.driver.restore(child.pid)
                    self.driver.unlock(child.pid)
                    self.parked = False
                    print("gpuswap slurm-wrap: restored the child's GPU memory", file=sys.stderr, flush=True)
                return
            if self.coord is not None and self.coord.attached():
                self.coord.preempt(f"slurm-wrap got {signal.Signals(signum).name}")
                return
            if self.driver is not None and not self.parked:
                try:
                    self.driver.lock(child.pid, 10_000)
                    self.driver.checkpoint(child.pid)
                    self.parked = True
                    print(f"gpuswap slurm-wrap: {signal.Signals(signum).name}: parked the child's "
                          "GPU memory in host RAM", file=sys.stderr, flush=True)
                    return
                except Exception as exc:
                    print(f"gpuswap slurm-wrap: transparent park failed ({exc}); forwarding",
                          file=sys.stderr, flush=True)
            print(f"gpuswap slurm-wrap: forwarding {signal.Signals(signum).name} to pid {child.pid}",
                  file=sys.stderr, flush=True)
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        for sig in self.signals:
            signal.signal(sig, self._on_signal)
        if self.driver is not None:
            signal.signal(signal.SIGCONT, self._on_signal)
        env = None
        if self.coord is not None:
            env = dict(os.environ, **{envvars.CONTROL: str(self.coord.path)})
        try:
            with self._lock:  # a signal arriving while the child starts waits for it, then is forwarded
                self.child = subprocess.Popen(self.cmd, env=env)
        except FileNotFoundError:
            print(f"gpuswap slurm-wrap: {self.cmd[0]}: command not found", file=sys.stderr)
            return EX_NOTFOUND
        except PermissionError as exc:
            print(f"gpuswap slurm-wrap: {exc}", file=sys.stderr)
            return EX_NOEXEC
        if self.coord is None:
            return exit_code(self.child.wait())
        try:
            return self._run_coordinated(self.child)
        finally:
            self.coord.close()

    def _run_coordinated(self, child: "subprocess.Popen[bytes]") -> int:
        """Wait for the launcher; after a committed checkpoint, requeue and exit 75 whatever it did."""
        assert self.coord is not None
        while child.poll() is None and not self.coord.committed.is_set():
            self.coord.committed.wait(0.5)
        if self.coord.committed.is_set():
            try:
                child.wait(LAUNCHER_GRACE_S)
            except subprocess.TimeoutExpired:
                print(f"gpuswap slurm-wrap: the launcher is still running {LAUNCHER_GRACE_S:g} s after the "
                      "checkpoint; stopping it", file=sys.stderr, flush=True)
                child.terminate()
                try:
                    child.wait(10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
        code = exit_code(child.wait())
        self.coord.kill_ranks()      # torchrun's workers lead sessions of their own: none outlives it
        if not self.coord.committed.is_set():
            return code
        from gpuswap.runtime import slurm
        from gpuswap.runtime.config import RuntimeConfig

        print(f"gpuswap slurm-wrap: the launcher exited {code} after the checkpoint; requeueing and exiting "
              f"{REQUEUE_EXIT_CODE}", file=sys.stderr, flush=True)
        slurm.requeue(RuntimeConfig(job_id=os.environ.get("SLURM_JOB_ID"), control=None, ckpt_dir=None,
                                    simulated=False, slurm=True), owner=True)
        return REQUEUE_EXIT_CODE

    def on_kill(self, reason: str) -> None:
        """The coordinator's verdict that the job cannot go on (a rank died mid-checkpoint)."""
        print(f"gpuswap slurm-wrap: ending the job: {reason}", file=sys.stderr, flush=True)
        child = self.child
        if child is not None and child.poll() is None:
            child.terminate()
        if self.coord is not None:
            self.coord.kill_ranks()


def cmd_slurm_wrap(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        print("gpuswap slurm-wrap: no command; usage: gpuswap slurm-wrap [options] -- CMD ...",
              file=sys.stderr)
        return EX_USAGE
    try:
        signals = (parse_signals(a.signals, "--signals") if a.signals is not None
                   else parse_signals(os.environ.get(envvars.SLURM_SIGNALS, DEFAULT_SIGNALS)))
    except ValueError as exc:
        print(f"gpuswap slurm-wrap: {exc}", file=sys.stderr)
        return EX_USAGE
    driver = _transparent() if a.park else None
    wrapper = Wrapper(cmd, signals, driver)
    if driver is None:
        wrapper.coord = _coordinator(wrapper)
    return wrapper.run()


def _coordinator(wrapper: Wrapper) -> Optional[Any]:
    """The in-job coordinator for a multi-rank CMD, under Slurm on one node; None (and why, when
    it matters) otherwise: a single-rank CMD never connects and is served exactly as before."""
    from gpuswap.runtime import slurm

    if not slurm.detect():
        return None
    from gpuswap.runtime import slurmcoord

    why = slurmcoord.why_not()
    if why is not None:
        print(f"gpuswap slurm-wrap: {why}; signals are forwarded only", file=sys.stderr, flush=True)
        return None
    try:
        coord = slurmcoord.CoordServer(slurmcoord.private_dir() / f"wrap-{os.getpid()}.sock", slurmcoord.timeout_s(),
                                       lambda reason: wrapper.on_kill(reason))
        coord.start()
    except OSError as exc:
        print(f"gpuswap slurm-wrap: cannot serve the ranks' coordinator ({exc}); signals are forwarded only",
              file=sys.stderr, flush=True)
        return None
    return coord
