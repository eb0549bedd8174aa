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

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from gpuswap.api.client import ClientError
from gpuswap.demo.story import real_gpu_count
from gpuswap.jobs import format_size
from gpuswap.protocol import env as envvars
from gpuswap.selftest import jobs, measure
from gpuswap.selftest.checks import evaluate
from gpuswap.selftest.harness import Failure, PendingReference, PrivateDaemon, Reference
from gpuswap.selftest.jobs import Files
from gpuswap.selftest.results import Check, GpuResult, Report, Scenario

GiB = 2**30
DEFAULT_SIZE_GIB = 4.0
SIMULATED_SIZE_GIB = 1 / 16          # 64 MiB of CPU tensors: what CI can afford
MAX_SIMULATED = 8                    # simulated GPUs: enough to test placement (each below held by a placeholder)
ALL = ("ram", "disk", "transparent")


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
    if importlib.util.find_spec("torch") is None:
        report.error = "the bundled jobs need PyTorch, which is not installed here: pip install 'gpuswap[torch]'"
        return report
    try:
        home = _make_home()
    except OSError as e:
        report.error = f"cannot make the selftest's directory: {e.strerror or e} ({e.filename or ''})"
        return report
    report.home, report.home_filesystem = str(home), measure.filesystem_of(str(home))
    story = Story(PrivateDaemon(home, simulated), size, opts, report)
    try:
        story.start(f"{indices[-1] + 1}x80GiB" if simulated else None)
        for n in indices:
            report.gpus.append(story.gpu(n))
    except (Failure, ClientError, RuntimeError, OSError) as e:
        report.error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    except Exception as e:   # never a traceback: the run's jobs and daemon are cleaned up below
        report.error = f"unexpected {type(e).__name__}: {e}"
    finally:
        story.daemon.close()
        if opts.keep or not report.ok:
            opts.progress(f"state kept in {home} (GPUSWAP_HOME={home} gpuswap ls)")
        else:
            shutil.rmtree(home, ignore_errors=True)
    return report


def _make_home() -> Path:
    """A fresh directory inside $GPUSWAP_HOME when set (the disk tier is then the one the machine's
    daemon parks to), else in the system's temporary directory, as `gpuswap demo` does."""
    base = Path(os.environ[envvars.HOME]).expanduser() if os.environ.get(envvars.HOME) else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="gpuswap-selftest-", dir=base))


class Story:
    """The scenarios, GPU by GPU, on the private daemon."""

    def __init__(self, daemon: PrivateDaemon, size: int, opts: Options, report: Report):
        self.daemon, self.size, self.opts, self.report = daemon, size, opts, report
        self.simulated, self.client, self.say = daemon.simulated, daemon.client, opts.progress
        self.transparent: dict[str, Any] = {}

    def start(self, simulate: Optional[str]) -> None:
        self.say(f"private daemon in {self.daemon.home} ({self.report.home_filesystem}); "
                 + ("SIMULATED GPUs" if self.simulated else "real GPUs"))
        info = self.daemon.start(simulate)
        self.report.daemon = info["description"]
        self.transparent = self.report.transparent = info.get("transparent") or {}

    def gpu(self, n: int) -> GpuResult:
        info = next(i for i in self.client.get("/v1/gpus")["gpus"] if i["index"] == n)
        g = GpuResult(n, info["name"], info["uuid"], bool(info["simulated"]))
        uuid = None if self.simulated else info["uuid"]
        only = set(self.opts.only or ALL)
        self.say(f"GPU {'sim ' if g.simulated else ''}{n} ({g.name}): --size {format_size(self.size)}")
        if not self._room(g, info):
            return g
        self.daemon.hold_gpus_below(n)
        seed = jobs.SEED + (1 if os.environ.get(envvars.SELFTEST_WRONG_REFERENCE) == "1" else 0)
        base = self.daemon.work / f"gpu{n}"
        hidden = jobs.hidden_for(self.size)
        coop_ref = plain_ref = None          # both run beside the floor probe, off every timed window
        if only & {"ram", "disk"}:
            self.say("  reference: the cooperative job run uninterrupted, outside gpuswap")
            files = Files(base / "coop-reference")
            coop_ref = self.daemon.reference(jobs.coop_argv(files, hidden, seed=seed), files, uuid)
        if "transparent" in only and self.transparent.get("available"):
            self.say("  reference: the unmodified script run uninterrupted, outside gpuswap")
            files = Files(base / "plain-reference")
            plain_ref = self.daemon.reference(jobs.plain_argv(files, self.size, seed=seed), files, uuid)
        if "ram" in only:
            self._floor(g, base)
        if coop_ref is not None:
            ref = self._collect(g, coop_ref, "cooperative job")
            if "ram" in only:
                g.scenarios.append(self._coop(g, "ram", hidden, ref, base))
                parked = g.scenarios[-1].parked_bytes or jobs.coop_state_bytes(hidden)
                self.say(f"  plain copy of {format_size(parked)} for comparison")
                g.plain_copy = measure.plain_copy(parked, self.simulated, uuid, self.daemon.env)
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
        """On a real GPU, room for both references side by side; in host RAM, for a park and the copy."""
        need_gpu = int(2.5 * self.size) + 2 * GiB      # AdamW's temporaries, three CUDA contexts
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
            jid = self.daemon.submit(jobs.coop_argv(files, jobs.PROBE_HIDDEN, jobs.PROBE_STEPS, jobs.PROBE_HOLD_AT),
                                     "selftest-floor", cwd=files.dir)
            m = self.daemon.wait_marker(jid, files.marker)
            self.daemon.placed_on(jid, g.index)
            g.floor = measure.read(self.client, int(m["pid"])).nvml_bytes
            if g.floor is None:
                g.floor_error = "NVML gave no per-process figure for the probe"
            j = self.daemon.finish(jid, files.gate)
            if j["state"] != "COMPLETED":
                g.floor_error = f"the probe ended {j['state']}: {j['reason']}"
        except (Failure, ClientError, OSError, ValueError) as e:
            g.floor_error = str(e)
            self.daemon.abandon(jid, files)
        if g.floor_error:
            g.checks.append(Check("context floor measured", False, g.floor_error))

    # -- the scenarios -------------------------------------------------------------------------
    def _coop(self, g: GpuResult, tier: str, hidden: int, ref: Reference, base: Path) -> Scenario:
        s = Scenario(tier, reference_sha256=ref.sha256, reference_device=ref.device, floor=g.floor)
        files = Files(base / tier).make()
        self.say(f"  {s.title}")
        try:
            s.job_id = self.daemon.submit(jobs.coop_argv(files, hidden), f"selftest-{tier}", cwd=files.dir)
            s.job_pid = int(self.daemon.wait_marker(s.job_id, files.marker)["pid"])
            self._cycle(s, g, files, tier, root=s.job_pid)
        except (Failure, ClientError, OSError, ValueError) as e:
            s.error = str(e)
            self.daemon.abandon(s.job_id, files)
        return self._settle(s)

    def _transparent(self, g: GpuResult, base: Path, ref: Reference) -> Scenario:
        s = Scenario("transparent", reference_sha256=ref.sha256, reference_device=ref.device)
        if not self.transparent.get("available"):
            s.status = "skipped"
            s.skip_reason = str(self.transparent.get("description") or "the driver path is unavailable")
            self.say(f"  {s.title}: skipped ({s.skip_reason})")
            return s
        files = Files(base / "transparent").make()
        self.say(f"  {s.title}")
        try:
            s.job_id = self.daemon.submit(jobs.under_shell(jobs.plain_argv(files, self.size)), "selftest-freeze",
                                          pause_mode="transparent", cwd=files.dir)
            m = self.daemon.wait_marker(s.job_id, files.marker)
            s.job_pid, s.shell_pid = int(m["pid"]), int(m["ppid"])
            s.shell_name = _name(s.shell_pid)
            self._cycle(s, g, files, "ram", root=s.shell_pid)
        except (Failure, ClientError, OSError, ValueError) as e:
            s.error = str(e)
            self.daemon.abandon(s.job_id, files)
        return self._settle(s)

    def _cycle(self, s: Scenario, g: GpuResult, files: Files, tier: str, root: int) -> None:
        """Look, pause, look, resume, look, let the job finish: the story every scenario tells.
        `root`: the job's process tree to look at (after a disk park, the restarted process's)."""
        assert s.job_id is not None
        jid, d = s.job_id, self.daemon
        d.placed_on(jid, g.index)
        before = measure.read(self.client, root)
        s.nvml_before, s.nvml_processes_before, s.rss_before = before.nvml_bytes, before.nvml_processes, before.rss_bytes
        t0 = time.monotonic()
        self.client.post(f"/v1/jobs/{jid}/pause", {"to": tier})
        j = d.until(jid, lambda j: j["state"] == "PAUSED", f"parked ({tier})",
                    fail=lambda j: j["state"] == "RUNNING" and not j["held"])     # refused or failed: says why
        s.park_end_to_end_s = time.monotonic() - t0
        s.parked, s.mechanism, s.parked_bytes = j["parked"], j["mechanism"], j["parked_bytes"]
        during = measure.read(self.client, root, before.pids)
        s.nvml_during, s.nvml_processes_during, s.rss_during = during.nvml_bytes, during.nvml_processes, during.rss_bytes
        s.mem_available_drop = before.mem_available - during.mem_available
        t0 = time.monotonic()
        self.client.post(f"/v1/jobs/{jid}/resume")
        d.until(jid, lambda j: j["state"] == "RUNNING" and j["parked"] is None, "running again")
        s.resume_end_to_end_s = time.monotonic() - t0
        if tier == "disk":    # restarted: a new process, held again at the step after its checkpoint
            root = s.job_pid_after = int(d.wait_marker(jid, files.marker, not_pid=s.job_pid)["pid"])
        d.placed_on(jid, g.index)
        after = measure.read(self.client, root, [] if tier == "disk" else before.pids)
        s.nvml_after, s.rss_after = after.nvml_bytes, after.rss_bytes
        j = d.finish(jid, files.gate)
        s.final_state, s.exit_code = j["state"], j["exit_code"]
        events = self.client.get(f"/v1/jobs/{jid}")["events"]
        s.park_s, s.resume_s = measure.move_seconds(events, s.key)
        s.restarted_at_step = measure.restarted_at(events)
        result = jobs.read_result(files.out)
        s.job_sha256, s.job_device = result.get("sha256"), result.get("device")

    def _settle(self, s: Scenario) -> Scenario:
        s.checks = evaluate(s, self.simulated, jobs.HOLD_AT)
        s.settle()
        self.say(f"    {s.status}")
        return s


def _name(pid: int) -> Optional[str]:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None
