"""`gpuswap selftest`: the proof, on this machine's GPUs, that parking works, told as a story.

A private daemon (its own GPUSWAP_HOME, socket and database; simulated GPUs where there is no
NVIDIA GPU or `--simulate` asks) runs, on each GPU under test, the bundled jobs through three
scenarios: a cooperative job paused to RAM and resumed, the same job paused to disk (exit 75,
requeued, restored), and an unmodified script under `sh -c` frozen and thawed by the CUDA driver
(where `gpuswap gpus` says the driver path is available; otherwise skipped with the reason).
Each job is held at one step (jobs.py) so that NVML, host RAM and the job's state are looked at
before, during and after the park at the same point of its run, and each must end COMPLETED with
parameters bitwise equal to an uninterrupted run of the same job made first, outside gpuswap.
The machine's own daemon is never contacted.

The daemon's placement takes the lowest free GPU, so to test GPU N the GPUs below it are held in
the private daemon's books by placeholder jobs that use no GPU; every job's placement is checked.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from gpuswap.api.client import Client, ClientError
from gpuswap.demo.story import real_gpu_count, start_private_daemon, stop_daemon
from gpuswap.jobs import format_size
from gpuswap.runtime.channel import ENV_HOME
from gpuswap.selftest import jobs, measure
from gpuswap.selftest.checks import evaluate
from gpuswap.selftest.jobs import Files
from gpuswap.selftest.results import Check, GpuResult, Report, Scenario

GiB = 2**30
DEFAULT_SIZE_GIB = 4.0
SIMULATED_SIZE_GIB = 1 / 16          # 64 MiB of CPU tensors: what CI can afford
WAIT_S = 900.0                       # a step that takes this long has failed (a loaded machine is slow)
DAEMON_ARGS = ("--min-runtime", "0", "--pause-timeout", "600", "--max-switch-fraction", "1", "--no-calibrate")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")
MAX_SIMULATED = 8                    # simulated GPUs: enough to test placement, each below held by a placeholder
# Test seam: the uninterrupted reference runs with another seed, so every hash check must fail.
WRONG_REFERENCE_ENV = "GPUSWAP_SELFTEST_WRONG_REFERENCE"


class Failure(Exception):
    """What stopped a scenario (or the run), in one line."""


class UsageProblem(Exception):
    """A request the selftest cannot serve as given (exit 64)."""


@dataclass
class Options:
    gpus: Optional[list[int]] = None        # NVML indices; None: every GPU
    size_gib: Optional[float] = None        # None: 4 on real GPUs, 1/16 on simulated ones
    simulate: bool = False
    only: Optional[list[str]] = None        # scenarios to run; None: all three
    keep: bool = False
    progress: Callable[[str], None] = field(default=lambda line: None)


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
        d = _read_json(self.files.out) or {}
        return Reference(d.get("sha256"), d.get("device"))


def run(opts: Options) -> Report:
    """Run the selftest; the report says what held. Raises UsageProblem for a bad request."""
    real = 0 if opts.simulate else real_gpu_count()
    simulated = real == 0
    indices = sorted(set(opts.gpus)) if opts.gpus else (list(range(real)) if real else [0])
    if real and indices[-1] >= real:
        raise UsageProblem(f"--gpu {indices[-1]}: this machine has {real} GPU(s) (0 to {real - 1})")
    if simulated and indices[-1] >= MAX_SIMULATED:
        raise UsageProblem(f"--gpu {indices[-1]}: on simulated GPUs, --gpu goes up to {MAX_SIMULATED - 1}")
    size_gib = opts.size_gib if opts.size_gib is not None else (SIMULATED_SIZE_GIB if simulated else DEFAULT_SIZE_GIB)
    size = int(size_gib * GiB)
    if size < 2**20:
        raise UsageProblem(f"--size {size_gib:g} GiB is too small: at least 1 MiB")
    report = Report(simulated=simulated, size_bytes=size)
    try:
        home = _make_home()
    except OSError as e:
        report.error = f"cannot make the selftest's directory: {e.strerror or e} ({e.filename or ''})"
        return report
    report.home, report.home_filesystem = str(home), measure.filesystem_of(str(home))
    story = Story(home, simulated, size, opts, report)
    try:
        story.start(f"{indices[-1] + 1}x80GiB" if simulated else None)
        for n in indices:
            report.gpus.append(story.gpu(n))
    except (Failure, ClientError, RuntimeError, OSError) as e:
        report.error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    except Exception as e:   # never a traceback: the run's jobs and daemon are cleaned up below
        report.error = f"unexpected {type(e).__name__}: {e}"
    finally:
        story.close()
        keep = opts.keep or not report.ok
        if keep:
            opts.progress(f"state kept in {home} (GPUSWAP_HOME={home} gpuswap ls)")
        else:
            shutil.rmtree(home, ignore_errors=True)
    return report


def _make_home() -> Path:
    """A fresh directory inside $GPUSWAP_HOME when set (the disk tier is then the one the machine's
    daemon parks to), else in the system's temporary directory, as `gpuswap demo` does."""
    base = Path(os.environ[ENV_HOME]).expanduser() if os.environ.get(ENV_HOME) else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="gpuswap-selftest-", dir=base))


class Story:
    """The private daemon and the jobs it runs for the selftest."""

    def __init__(self, home: Path, simulated: bool, size: int, opts: Options, report: Report):
        self.home, self.simulated, self.size, self.opts, self.report = home, simulated, size, opts, report
        self.say = opts.progress
        self.work = home / "work"
        self.daemon: Optional[subprocess.Popen] = None
        self.client = Client(home, timeout=120)
        self.env = jobs.job_env()
        self.blockers: list[tuple[int, Path]] = []
        self.live: set[int] = set()
        self.references: list[subprocess.Popen] = []
        self.transparent: dict[str, Any] = {}

    # -- the daemon --------------------------------------------------------------------------
    def start(self, simulate: Optional[str]) -> None:
        self.say(f"private daemon in {self.home} ({self.report.home_filesystem}); "
                 + ("SIMULATED GPUs" if self.simulated else "real GPUs"))
        self.work.mkdir()
        self.daemon = start_private_daemon(self.home, simulate, DAEMON_ARGS, timeout=180)
        info = self.client.get("/v1/gpus")
        if bool(info["simulated"]) != self.simulated:
            raise Failure(f"the private daemon's GPUs are {'' if info['simulated'] else 'not '}simulated, "
                          "unlike what this process found")
        self.report.daemon = info["description"]
        self.transparent = info.get("transparent") or {}
        self.report.transparent = self.transparent

    def close(self) -> None:
        """End every job this run started (none is left held or parked), then the daemon."""
        for _, gate in self.blockers:
            gate.touch()
        for proc in self.references:       # only a run stopped early leaves one running
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self.daemon is None:
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
        stop_daemon(self.daemon)
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
            m = _read_json(path)
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

    def reference(self, argv: list[str], files: Files, uuid: Optional[str]) -> "PendingReference":
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

    # -- one GPU -----------------------------------------------------------------------------
    def gpu(self, n: int) -> GpuResult:
        info = next(i for i in self.client.get("/v1/gpus")["gpus"] if i["index"] == n)
        g = GpuResult(n, info["name"], info["uuid"], bool(info["simulated"]))
        uuid = None if self.simulated else info["uuid"]
        only = set(self.opts.only or ("ram", "disk", "transparent"))
        self.say(f"GPU {'sim ' if g.simulated else ''}{n} ({g.name}): --size {format_size(self.size)}")
        if not self._room(g, info):
            return g
        self.hold_gpus_below(n)
        seed = jobs.SEED + (1 if os.environ.get(WRONG_REFERENCE_ENV) == "1" else 0)
        base = self.work / f"gpu{n}"
        hidden = jobs.hidden_for(self.size)
        coop_ref = plain_ref = None
        if only & {"ram", "disk"}:
            self.say("  reference: the cooperative job run uninterrupted, outside gpuswap")
            files = Files(base / "coop-reference")
            coop_ref = self.reference(jobs.coop_argv(files, hidden, seed=seed), files, uuid)
        if "transparent" in only and self.transparent.get("available"):
            self.say("  reference: the unmodified script run uninterrupted, outside gpuswap")
            files = Files(base / "plain-reference")
            plain_ref = self.reference(jobs.plain_argv(files, self.size, seed=seed), files, uuid)
        if "ram" in only:
            self._floor(g, base)
        if coop_ref is not None:
            ref = self._collect(g, coop_ref, "cooperative job")
            if "ram" in only:
                g.scenarios.append(self._coop(g, "ram", hidden, ref, base))
                parked = g.scenarios[-1].parked_bytes or jobs.coop_state_bytes(hidden)
                self.say(f"  plain copy of {format_size(parked)} for comparison")
                g.plain_copy = measure.plain_copy(parked, self.simulated, uuid, self.env)
                if g.plain_copy.error:
                    g.checks.append(Check("plain pinned copy timed", False, g.plain_copy.error))
            if "disk" in only:
                g.scenarios.append(self._coop(g, "disk", hidden, ref, base))
        if "transparent" in only:
            ref = self._collect(g, plain_ref, "unmodified script") if plain_ref else Reference()
            g.scenarios.append(self._transparent(g, base, ref))
        return g

    def _collect(self, g: GpuResult, pending: PendingReference, what: str) -> Reference:
        ref = pending.result()
        if ref.error:
            g.checks.append(Check(f"uninterrupted reference run ({what})", False, ref.error))
        return ref

    def _room(self, g: GpuResult, info: dict[str, Any]) -> bool:
        """On a real GPU, room for the largest job and the copy; in RAM, for a park and the copy."""
        need_gpu = int(2.5 * self.size) + 2 * GiB      # both references at once: AdamW's temporaries, contexts
        need_ram = 2 * self.size + GiB
        free_gpu = info["mem_total"] - (info["mem_used"] or 0)
        free_ram = measure.mem_available()
        ok = True
        if not self.simulated:
            ok = free_gpu >= need_gpu
            g.checks.append(Check("room on the GPU", ok, f"{format_size(free_gpu)} free",
                                  f"≥ {format_size(need_gpu)} (2.5 × --size + 2 GiB)",
                                  "" if ok else "free the GPU or lower --size"))
        room = free_ram >= need_ram
        g.checks.append(Check("room in host RAM", room, f"{format_size(free_ram)} available",
                              f"≥ {format_size(need_ram)} (2 × --size + 1 GiB)", "" if room else "lower --size"))
        return ok and room

    def _floor(self, g: GpuResult, base: Path) -> None:
        """NVML of the cooperative job holding (almost) nothing, held like the others: the floor."""
        files = Files(base / "floor").make()
        self.say("  floor probe: the same job with a few KiB of state")
        jid = None
        try:
            jid = self.submit(jobs.coop_argv(files, jobs.PROBE_HIDDEN, jobs.PROBE_STEPS, jobs.PROBE_HOLD_AT),
                              "selftest-floor", cwd=files.dir)
            m = self.wait_marker(jid, files.marker)
            self.placed_on(jid, g.index)
            r = measure.read(self.client, int(m["pid"]))
            g.floor = r.nvml_bytes
            if g.floor is None:
                g.floor_error = "NVML gave no per-process figure for the probe"
            j = self.finish(jid, files.gate)
            if j["state"] != "COMPLETED":
                g.floor_error = f"the probe ended {j['state']}: {j['reason']}"
        except (Failure, ClientError, OSError, ValueError) as e:
            g.floor_error = str(e)
            self._abandon(jid, files)
        if g.floor_error:
            g.checks.append(Check("context floor measured", False, g.floor_error))

    def _abandon(self, jid: Optional[int], files: Files) -> None:
        files.gate.touch()
        if jid is not None and jid in self.live:
            try:
                self.client.post(f"/v1/jobs/{jid}/cancel")
            except ClientError:
                pass

    def _coop(self, g: GpuResult, tier: str, hidden: int, ref: Reference, base: Path) -> Scenario:
        s = Scenario(tier, reference_sha256=ref.sha256, reference_device=ref.device, floor=g.floor)
        files = Files(base / tier).make()
        self.say(f"  {s.title}")
        try:
            s.job_id = self.submit(jobs.coop_argv(files, hidden), f"selftest-{tier}", cwd=files.dir)
            s.job_pid = int(self.wait_marker(s.job_id, files.marker)["pid"])
            self.placed_on(s.job_id, g.index)
            before = self._before(s, s.job_pid)
            j = self._pause(s, tier)
            during = measure.read(self.client, s.job_pid, before.pids)
            self._during(s, before, during)
            t0 = time.monotonic()
            self.client.post(f"/v1/jobs/{s.job_id}/resume")
            self.until(s.job_id, lambda j: j["state"] == "RUNNING" and j["parked"] is None, "resumed")
            s.resume_end_to_end_s = time.monotonic() - t0
            pid = s.job_pid
            if tier == "disk":    # restarted: a new process, held again at the step after its checkpoint
                pid = s.job_pid_after = int(self.wait_marker(s.job_id, files.marker, not_pid=s.job_pid)["pid"])
            self.placed_on(s.job_id, g.index)
            after = measure.read(self.client, pid)
            s.nvml_after, s.rss_after = after.nvml_bytes, after.rss_bytes
            self._end(s, files, tier)
        except (Failure, ClientError, OSError, ValueError) as e:
            s.error = str(e)
            self._abandon(s.job_id, files)
        s.checks = evaluate(s, self.simulated, jobs.HOLD_AT)
        s.settle()
        self.say(f"    {s.status}")
        return s

    def _transparent(self, g: GpuResult, base: Path, ref: Reference) -> Scenario:
        s = Scenario("transparent", reference_sha256=ref.sha256, reference_device=ref.device)
        if not self.transparent.get("available"):
            s.status, s.skip_reason = "skipped", str(self.transparent.get("description") or "the driver path is unavailable")
            self.say(f"  {s.title}: skipped ({s.skip_reason})")
            return s
        files = Files(base / "transparent").make()
        self.say(f"  {s.title}")
        try:
            s.job_id = self.submit(jobs.under_shell(jobs.plain_argv(files, self.size)), "selftest-freeze",
                                   pause_mode="transparent", cwd=files.dir)
            m = self.wait_marker(s.job_id, files.marker)
            s.job_pid, s.shell_pid = int(m["pid"]), int(m["ppid"])
            s.shell_name = _name(s.shell_pid)
            self.placed_on(s.job_id, g.index)
            before = self._before(s, s.shell_pid)
            self._pause(s, "ram")
            during = measure.read(self.client, s.shell_pid, before.pids)
            self._during(s, before, during)
            t0 = time.monotonic()
            self.client.post(f"/v1/jobs/{s.job_id}/resume")
            self.until(s.job_id, lambda j: j["state"] == "RUNNING" and j["parked"] is None, "thawed")
            s.resume_end_to_end_s = time.monotonic() - t0
            self.placed_on(s.job_id, g.index)
            after = measure.read(self.client, s.shell_pid, before.pids)
            s.nvml_after, s.rss_after = after.nvml_bytes, after.rss_bytes
            self._end(s, files, "transparent")
        except (Failure, ClientError, OSError, ValueError) as e:
            s.error = str(e)
            self._abandon(s.job_id, files)
        s.checks = evaluate(s, self.simulated, jobs.HOLD_AT)
        s.settle()
        self.say(f"    {s.status}")
        return s

    # -- the steps every scenario shares -----------------------------------------------------
    def _before(self, s: Scenario, root: int) -> measure.Reading:
        r = measure.read(self.client, root)
        s.nvml_before, s.nvml_processes_before, s.rss_before = r.nvml_bytes, r.nvml_processes, r.rss_bytes
        return r

    def _pause(self, s: Scenario, tier: str) -> dict[str, Any]:
        assert s.job_id is not None
        t0 = time.monotonic()
        self.client.post(f"/v1/jobs/{s.job_id}/pause", {"to": tier})
        j = self.until(s.job_id, lambda j: j["state"] == "PAUSED", f"parked ({tier})",
                       fail=lambda j: j["state"] == "RUNNING" and not j["held"])
        s.park_end_to_end_s = time.monotonic() - t0
        s.parked, s.mechanism, s.parked_bytes = j["parked"], j["mechanism"], j["parked_bytes"]
        return j

    def _during(self, s: Scenario, before: measure.Reading, during: measure.Reading) -> None:
        s.nvml_during, s.nvml_processes_during = during.nvml_bytes, during.nvml_processes
        s.rss_during = during.rss_bytes
        s.mem_available_drop = before.mem_available - during.mem_available

    def _end(self, s: Scenario, files: Files, kind: str) -> None:
        assert s.job_id is not None
        j = self.finish(s.job_id, files.gate)
        s.final_state, s.exit_code = j["state"], j["exit_code"]
        events = self.client.get(f"/v1/jobs/{s.job_id}")["events"]
        s.park_s, s.resume_s = measure.move_seconds(events, kind)
        s.restarted_at_step = measure.restarted_at(events)
        result = _read_json(files.out) or {}
        s.job_sha256, s.job_device = result.get("sha256"), result.get("device")


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _name(pid: int) -> Optional[str]:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None
