"""The selftest's harness: its private daemon (never the machine's), the jobs it runs there, and
the uninterrupted reference runs outside it. Every wait is on a fact (a state, a marker file), with
a generous limit that only catches what has failed."""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from gpuswap.api.client import Client, ClientError
from gpuswap.demo.story import start_private_daemon, stop_daemon
from gpuswap.jobs import ENDED
from gpuswap.selftest import jobs
from gpuswap.selftest.jobs import Files

WAIT_S = 900.0                       # a step that takes this long has failed (a loaded machine is slow)
DAEMON_ARGS = ("--min-runtime", "0", "--protect-multiple", "0", "--pause-timeout", "600", "--max-switch-fraction", "1",
               "--no-calibrate")   # no anti-thrashing: its scenarios preempt at once
TERMINAL = ENDED


class Failure(Exception):
    """What stopped a scenario (or the run), in one line."""


@dataclass
class Reference:
    sha256: Optional[str] = None
    device: Optional[str] = None
    error: str = ""


@dataclass
class PendingReference:
    proc: subprocess.Popen
    files: Files

    def result(self) -> Reference:
        try:
            code = self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return Reference(error=f"the uninterrupted reference run took over {WAIT_S:.0f} s")
        if code != 0:
            lines = (self.files.dir / "reference.log").read_text(errors="replace").strip().splitlines()
            return Reference(error=f"the uninterrupted reference run failed: {(lines or [f'exit {code}'])[-1]}")
        d = jobs.read_result(self.files.out)
        return Reference(d.get("sha256"), d.get("device"))


class PrivateDaemon:
    """A `gpuswap server` on the selftest's own home, and the jobs the selftest submits to it."""

    def __init__(self, home: Path, simulated: bool):
        self.home, self.simulated = home, simulated
        self.work = home / "work"
        self.proc: Optional[subprocess.Popen] = None
        self.client = Client(home, timeout=120)
        self.env = jobs.job_env()
        self.blockers: list[tuple[int, Path]] = []
        self.live: set[int] = set()
        self.references: list[subprocess.Popen] = []

    def start(self, simulate: Optional[str]) -> dict[str, Any]:
        """Start it; returns its GPUs (`GET /v1/gpus`)."""
        self.work.mkdir()
        self.proc = start_private_daemon(self.home, simulate, DAEMON_ARGS, timeout=180)
        info = self.client.get("/v1/gpus")
        if bool(info["simulated"]) != self.simulated:
            raise Failure(f"the private daemon's GPUs are {'' if info['simulated'] else 'not '}simulated, "
                          "unlike what this process found")
        return info

    def close(self) -> None:
        """End every job this run started (none is left held or parked), then the daemon."""
        for _, gate in self.blockers:
            gate.touch()
        for proc in self.references:       # only a run stopped early leaves one running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.proc is None:
            return
        for jid in sorted(self.live):
            try:
                self.client.post(f"/v1/jobs/{jid}/cancel")
            except ClientError:
                pass
        deadline = time.monotonic() + 60
        while self.live and time.monotonic() < deadline:
            for jid in sorted(self.live):
                try:
                    if self.client.get(f"/v1/jobs/{jid}")["state"] in TERMINAL:
                        self.live.discard(jid)
                except ClientError:
                    self.live.discard(jid)
            time.sleep(0.2)
        stop_daemon(self.proc)
        self.client.close()

    # -- jobs --------------------------------------------------------------------------------
    def submit(self, argv: list[str], name: str, pause_mode: str = "cooperative", priority: str = "normal",
               preemptible: bool = True, cwd: Optional[Path] = None) -> int:
        jid = int(self.client.post("/v1/jobs", {
            "argv": argv, "cwd": str(cwd or self.work), "env": self.env, "name": name, "priority": priority,
            "gpus": 1, "pause_mode": pause_mode, "preemptible": preemptible})["id"])
        self.live.add(jid)
        return jid

    def job(self, jid: int) -> dict[str, Any]:
        j = self.client.get(f"/v1/jobs/{jid}")
        if j["state"] in TERMINAL:
            self.live.discard(jid)
        return j

    def until(self, jid: int, pred: Callable[[dict[str, Any]], bool], what: str,
              fail: Optional[Callable[[dict[str, Any]], bool]] = None) -> dict[str, Any]:
        """Poll job `jid` until `pred` holds; a job that ends (or meets `fail`) first is a Failure."""
        deadline = time.monotonic() + WAIT_S
        while True:
            j = self.job(jid)
            if pred(j):
                return j
            if j["state"] in TERMINAL or (fail is not None and fail(j)):
                raise Failure(f"job {jid} is {j['state']} ({j['reason']}) instead of {what}")
            if time.monotonic() > deadline:
                raise Failure(f"job {jid} was not {what} within {WAIT_S:.0f} s ({j['state']}: {j['reason']})")
            time.sleep(0.05)

    def wait_marker(self, jid: int, path: Path, not_pid: Optional[int] = None) -> dict[str, Any]:
        """The job's marker ({"pid", ...}) once it is held (written by a process other than `not_pid`)."""
        deadline, next_look = time.monotonic() + WAIT_S, 0.0
        while True:
            m = jobs.read_result(path) or None
            if m is not None and m.get("pid") != not_pid:
                return m
            now = time.monotonic()
            if now >= next_look:
                j = self.job(jid)
                if j["state"] in TERMINAL:
                    raise Failure(f"job {jid} ended {j['state']} ({j['reason']}) before it was held")
                next_look = now + 0.5
            if now > deadline:
                raise Failure(f"job {jid} was not held at its step within {WAIT_S:.0f} s")
            time.sleep(0.05)

    def placed_on(self, jid: int, n: int) -> None:
        got = self.job(jid)["assigned_gpus"]
        if got != [n]:
            raise Failure(f"the private daemon placed job {jid} on GPU {got}, not on GPU {n}")

    def finish(self, jid: int, gate: Path) -> dict[str, Any]:
        gate.touch()
        return self.until(jid, lambda j: j["state"] in TERMINAL, "ended")

    def hold_gpus_below(self, n: int) -> None:
        """Placeholder jobs on GPUs 0..n-1, so that the next job lands on GPU n."""
        while len(self.blockers) < n:
            i = len(self.blockers)
            gate = self.work / f"blocker{i}.gate"
            jid = self.submit(jobs.blocker_argv(gate), f"selftest-placeholder-{i}", priority="high",
                              preemptible=False)
            self.blockers.append((jid, gate))
            self.until(jid, lambda j: j["state"] == "RUNNING", "running")
            self.placed_on(jid, i)

    def reference(self, argv: list[str], files: Files, uuid: Optional[str]) -> PendingReference:
        """Start the job uninterrupted outside gpuswap (its gate open from the start); `.result()`
        waits for it. References run beside each other and beside the floor probe: no figure is
        taken from them, and each costs a Python and PyTorch start-up."""
        files.make()
        files.gate.touch()
        log = open(files.dir / "reference.log", "wb")
        proc = subprocess.Popen(argv, env=jobs.reference_env(self.simulated, uuid), cwd=files.dir,
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.references.append(proc)
        return PendingReference(proc, files)

    def abandon(self, jid: Optional[int], files: Files) -> None:
        """After a failure: let the job go and cancel it (close() waits for it to end)."""
        files.gate.touch()
        if jid is not None and jid in self.live:
            try:
                self.client.post(f"/v1/jobs/{jid}/cancel")
            except ClientError:
                pass
