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
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from typing import Any, Optional

from gpuswap.runtime.slurm import DEFAULT_SIGNALS, ENV_SIGNALS, parse_signals

EX_USAGE = 64
EX_NOEXEC = 126
EX_NOTFOUND = 127


def register(sub: Any) -> None:
    """Add the `slurm-wrap` verb to the gpuswap command line."""
    s = sub.add_parser("slurm-wrap", help="run CMD under Slurm, forwarding preemption signals: "
                                          "gpuswap slurm-wrap [--signals USR2,TERM] -- CMD ...")
    s.add_argument("--signals", help=f"signals to forward (default ${ENV_SIGNALS}, else {DEFAULT_SIGNALS}; "
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

    def __init__(self, cmd: list[str], signals: list[signal.Signals], driver: Optional[Any]) -> None:
        self.cmd, self.signals, self.driver = cmd, signals, driver
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
        try:
            with self._lock:  # a signal arriving while the child starts waits for it, then is forwarded
                self.child = subprocess.Popen(self.cmd)
        except FileNotFoundError:
            print(f"gpuswap slurm-wrap: {self.cmd[0]}: command not found", file=sys.stderr)
            return EX_NOTFOUND
        except PermissionError as exc:
            print(f"gpuswap slurm-wrap: {exc}", file=sys.stderr)
            return EX_NOEXEC
        while True:
            try:
                return exit_code(self.child.wait())
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue


def cmd_slurm_wrap(a: argparse.Namespace) -> int:
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        print("gpuswap slurm-wrap: no command; usage: gpuswap slurm-wrap [options] -- CMD ...",
              file=sys.stderr)
        return EX_USAGE
    try:
        signals = (parse_signals(a.signals, "--signals") if a.signals is not None
                   else parse_signals(os.environ.get(ENV_SIGNALS, DEFAULT_SIGNALS)))
    except ValueError as exc:
        print(f"gpuswap slurm-wrap: {exc}", file=sys.stderr)
        return EX_USAGE
    driver = _transparent() if a.park else None
    return Wrapper(cmd, signals, driver).run()
