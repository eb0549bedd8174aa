"""What a freeze given up on leaves in the driver is put back, whatever happens to the daemon.

A freeze is refused when its user stops the job's CUDA process (`kill -STOP`): the driver answers
nothing about a stopped process, so what the freeze already took (a lock, a checkpoint) can only
be put back once the process is continued. If that waited on a thread of the daemon, a daemon
stopped meanwhile lost it: the restarted daemon saw a RUNNING job, and every CUDA call of the
continued process blocked for ever. Real daemon, real job processes and signals, the strict
simulated driver (node/simdriver.py), which blocks on a stopped process as the real one does."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

from gpuswap.simcuda import SimDevice, stopped
from gpuswap_testing import FACT_TIMEOUT_S, Gate
from test_transparent_e2e import GiB, fake, gpu0, wait_file


def until(fact: Callable[[], bool], what: str) -> None:
    """Wait for a fact (the deadline only catches one that never comes)."""
    deadline = time.monotonic() + FACT_TIMEOUT_S
    while not fact():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def driver_state(device: SimDevice, pid: int) -> str:
    reg = device.registration(pid)
    assert reg is not None, f"process {pid} is no simulated CUDA process"
    return device.driver_record(reg).state


def opened(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (its /proc/PID/fd)."""
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return True
    return False


@contextlib.contextmanager
def locked_after_a_stop(daemon, home: Path, job: int, pid: int) -> Iterator[None]:
    """The job's CUDA process is locked by the daemon's freeze and stopped by its user, in that
    order, on every run however loaded the machine. The test holds the simulated device's lock
    (which the driver's lock takes last, after its look at the process); once the daemon has the
    lock file open its lock call is past that look, the process is stopped, and the lock released:
    the call locks a stopped process, and the freeze's next question finds it stopped."""
    device = SimDevice(home / "simulated-driver")
    with device.exclusive():
        assert daemon.cli("pause", str(job)).returncode == 0
        until(lambda: opened(daemon.proc.pid, home / "simulated-driver" / "lock"), "the daemon's lock call waits")
        os.kill(pid, signal.SIGSTOP)
        until(lambda: stopped(pid), "the process is stopped")
    until(lambda: driver_state(device, pid) == "locked", "the process is locked")
    yield


def test_a_daemon_killed_while_its_undo_waits_still_unlocks_the_job(daemon, home):
    """The freeze is refused (its process locked, then stopped by its user); the daemon is killed
    with SIGKILL while the process is still stopped and locked, and started again; the user
    continues the process. The restarted daemon knows from the freeze's record beside the job that
    the driver may hold it, unlocks it once it runs, and says so: the job completes. Before, the
    undo was a thread of the killed daemon and the job's next CUDA call blocked for ever."""
    gate = Gate(home / "go")
    cmd, ready = fake(home, GiB, gate)
    job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], priority="low")
    wait_file(daemon, job, ready)
    [proc] = gpu0(daemon)["processes"]
    pid, device = proc["pid"], SimDevice(home / "simulated-driver")
    try:
        with locked_after_a_stop(daemon, home, job, pid):
            j = daemon.until(job, lambda j: "cannot freeze" in j["reason"])
        assert j["state"] == "RUNNING" and "stopped by a signal" in j["reason"], j["reason"]
        daemon.kill9()
        daemon.start()
        assert driver_state(device, pid) == "locked"        # what the killed daemon left behind
    finally:
        os.kill(pid, signal.SIGCONT)
    # The gate opens only once the put-back is recorded. Continued and unlocked, the job holds at
    # its gate (its last line); with the gate open it ended a few ms after the unlock, and the
    # daemon's next tick saw the exit first and recorded COMPLETED with no put_back event (the
    # unlock was done, its event never made): 1 run in 40 unloaded, 12 in 14 with two CPU hogs,
    # where the slow `pause` CLI let the job reach its gate before the lock.
    daemon.until(job, lambda j: any("put back" in e["reason"] for e in j["events"]))
    gate.open()
    done = daemon.state(job, "COMPLETED", "FAILED", "CANCELLED")
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0, done
    put_back = [e["reason"] for e in done["events"] if "put back" in e["reason"]]
    assert len(put_back) == 1 and f"unlocked CUDA process {pid}" in put_back[0], done["events"]
    assert "stopped by a signal" in put_back[0] and put_back[0].endswith("it can be frozen transparently again")
    assert daemon.cli("logs", str(job)).stdout.split() == [str(i) for i in range(1, 101)] + ["end"]
