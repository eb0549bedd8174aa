"""`gpuswap selftest` end to end: the real CLI starts its own private daemon, runs the bundled jobs
as real processes through a RAM park, a disk park and a transparent freeze (simulated GPUs and the
strict simulated driver here; a real GPU in the `gpu`-marked test), and exits 0 only if every
check holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuswap import simcuda
from gpuswap.selftest import checks, jobs
from gpuswap.selftest.results import Scenario
from gpuswap.protocol.env import SELFTEST_WRONG_REFERENCE as WRONG_REFERENCE_ENV

MiB, GiB = 2**20, 2**30


def selftest(base: Path, *args: str, extra_env: dict[str, str] | None = None,
             timeout: float = 800) -> subprocess.CompletedProcess:
    """The real CLI; its private daemon's directory goes inside `base` (GPUSWAP_HOME)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    env.update(GPUSWAP_HOME=str(base), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "selftest", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def left_behind(base: Path) -> list[str]:
    """Processes the run left (every job, supervisor and gate of it names a path inside `base`)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(base) in part for part in p.info["cmdline"] or []):
            out.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])}")
    return out


@pytest.fixture
def base(home: Path) -> Any:
    yield home
    for p in psutil.process_iter(["cmdline"]):      # only after a failed assertion: the run's own leftovers
        if any(str(home) in part for part in p.info["cmdline"] or []):
            try:
                p.kill()
            except psutil.Error:
                pass


@pytest.mark.timeout(900)   # six PyTorch processes and a daemon: minutes on a loaded machine
def test_simulated_selftest_passes_and_says_nothing_real_was_measured(base):
    r = selftest(base, "--simulate", "--json")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "SIMULATED GPUs: NOTHING REAL WAS MEASURED" in r.stderr and "Traceback" not in r.stderr
    d = json.loads(r.stdout)
    assert d["simulated"] is True and d["ok"] is True and d["failed_checks"] == [] and d["error"] == ""
    assert "nothing real was measured" in d["note"]
    [gpu] = d["gpus"]
    assert gpu["index"] == 0 and gpu["simulated"] is True
    ram, disk, freeze = gpu["scenarios"]
    assert [s["key"] for s in (ram, disk, freeze)] == ["ram", "disk", "transparent"]
    for s in (ram, disk, freeze):
        assert s["status"] == "passed" and s["final_state"] == "COMPLETED" and s["exit_code"] == 0, s
        assert s["job_sha256"] == s["reference_sha256"] and len(s["job_sha256"]) == 64
        assert s["job_device"] == s["reference_device"] == "cpu"
        assert s["park_s"] is not None and s["resume_s"] is not None
        assert s["bandwidth"] == {"note": "simulated: timings are not bandwidths"}     # no GB/s for simulated moves
        assert all(c["ok"] is not False for c in s["checks"]) and len(s["checks"]) >= 6
    # the RAM park: the runtime's; the floor measured by the probe (the simulated context floor here)
    assert ram["parked"] == "ram" and ram["mechanism"] == "cooperative"
    # parameters, gradients, AdamW's moments (and, on the CPU standing in for a GPU, AdamW's step counters)
    assert 0 <= ram["parked_bytes"] - jobs.coop_state_bytes(jobs.hidden_for(GiB // 16)) <= 1024
    assert gpu["floor"] is not None and ram["nvml_during"] <= gpu["floor"] + checks.margin(ram["parked_bytes"])
    [seen] = [c for c in ram["checks"] if c["name"].startswith("NVML sees")]
    # the simulated device lists the job's process as the context floor plus its attached tensors
    # (its attached bytes, within the few KiB of optimizer step counters that the park also counts)
    assert gpu["floor"] > 0 and abs(ram["nvml_before"] - gpu["floor"] - ram["parked_bytes"]) <= 64 * 1024, (gpu, ram)
    assert seen["ok"] is True, seen
    # the disk park: checkpoint, exit 75, a new process restored from the held step
    assert disk["parked"] == "disk" and disk["restarted_at_step"] == jobs.HOLD_AT
    assert disk["job_pid_after"] not in (None, disk["job_pid"]) and disk["nvml_during"] == 0
    # the freeze: the script's own process (the shell's child) found in the simulated NVML list and
    # frozen, with its tensors and its CUDA context, as NVML lists a real one; the checkpoint frees both
    held = GiB // 16 + simcuda.DEFAULT_CONTEXT_BYTES
    assert freeze["mechanism"] == "transparent" and freeze["parked_bytes"] == held
    assert freeze["shell_pid"] != freeze["job_pid"]
    assert freeze["nvml_processes_before"] == [[freeze["job_pid"], held]]
    assert (freeze["nvml_before"], freeze["nvml_during"], freeze["nvml_after"]) == (held, 0, held)
    # the simulated driver makes no host copy: that check says so (n/a) instead of passing on nothing
    [host] = [c for c in freeze["checks"] if c["name"].startswith("host RAM used")]
    assert host["ok"] is None and "no host copy" in host["note"], host
    assert gpu["plain_copy"]["kind"].startswith("host memcpy") and gpu["plain_copy"]["nbytes"] == ram["parked_bytes"]
    assert not left_behind(base) and list(base.iterdir()) == []      # passed: its directory is gone


@pytest.mark.timeout(900)
def test_a_failed_check_exits_1_and_is_named(base):
    """A deliberately wrong reference (another seed: a test seam) on the second simulated GPU: the
    job is placed there behind a placeholder, its park passes, and only the hash check fails."""
    r = selftest(base, "--simulate", "--gpu", "1", "--only", "ram", extra_env={WRONG_REFERENCE_ENV: "1"})
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "Traceback" not in out + r.stderr
    assert out.count("SIMULATED GPUs: NOTHING REAL WAS MEASURED") == 2 and "GPU sim 1" in out
    assert "FAILED: 1 of" in out
    assert "GPU 1 ram: final parameters bitwise equal to the uninterrupted run" in out
    assert "times (sim) are of simulated moves: they are not bandwidths, and no GB/s is given" in out
    assert "GB/s" not in out.replace("no GB/s is given", "")
    kept = [p for p in base.iterdir() if p.name.startswith("gpuswap-selftest-")]
    assert len(kept) == 1 and f"state kept in {kept[0]}" in r.stderr
    assert not left_behind(base)


@pytest.mark.parametrize("args", [["--size", "0"], ["--size", "nan"], ["--gpu", "-1"], ["--only", "swap"],
                                  ["--simulate", "--gpu", "8"]])
def test_usage_errors_exit_64_in_one_line(base, args):
    r = selftest(base, *args, timeout=120)
    assert r.returncode == 64, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr and r.stdout == ""


def test_the_floor_check_holds_for_any_floor_and_fails_when_the_park_frees_nothing():
    """The floor is measured (a real GPU's context, or the simulated device's; 0 where a device
    shows none): the check is against it whatever it is."""
    def ram(floor: int, before: int, during: int, parked: int) -> bool:
        s = Scenario("ram", floor=floor, nvml_before=before, nvml_during=during, nvml_after=before,
                     parked_bytes=parked)
        [c] = [c for c in checks.evaluate(s, simulated=False, hold_at=jobs.HOLD_AT) if c.name.startswith("NVML during")]
        return bool(c.ok)

    assert ram(floor=0, before=0, during=0, parked=64 * MiB)
    assert ram(floor=500 * MiB, before=500 * MiB + 4 * GiB, during=520 * MiB, parked=4 * GiB)
    assert not ram(floor=500 * MiB, before=500 * MiB + 4 * GiB, during=500 * MiB + 4 * GiB, parked=4 * GiB)
    assert not ram(floor=0, before=GiB, during=GiB, parked=GiB)


@pytest.mark.gpu
@pytest.mark.timeout(1800)
def test_selftest_on_a_real_gpu(base):
    r = selftest(base, "--size", "1", "--json", timeout=1700)
    d = json.loads(r.stdout) if r.stdout.strip() else {}
    assert r.returncode == 0, (d.get("failed_checks"), r.stderr[-4000:])
    assert d["simulated"] is False and "SIMULATED" not in r.stderr
    for gpu in d["gpus"]:
        ram = gpu["scenarios"][0]
        assert ram["key"] == "ram" and ram["nvml_before"] > ram["nvml_during"] + 0.9 * ram["parked_bytes"]
        assert ram["bandwidth"]["park_gbps"] and ram["bandwidth"]["pinned_d2h_gbps"]
        assert gpu["plain_copy"]["kind"].startswith("pinned")


def test_a_real_gpu_report_renders_bandwidths_and_a_skipped_freeze():
    """The real-GPU report cannot run here; its drawing can: GB/s beside the pinned copy and their
    ratio, a freeze skipped with the driver's reason (not a failure), and a JSON document."""
    import io

    from rich.console import Console

    from gpuswap.selftest import report
    from gpuswap.selftest.measure import PlainCopy
    from gpuswap.selftest.results import GpuResult, Report

    ram = Scenario("ram", status="passed", parked="ram", mechanism="cooperative", parked_bytes=4 * GiB,
                   nvml_before=4 * GiB + 600 * MiB, nvml_during=600 * MiB, nvml_after=4 * GiB + 600 * MiB,
                   floor=590 * MiB, rss_before=GiB, rss_during=5 * GiB, rss_after=5 * GiB, park_s=0.2, resume_s=0.25,
                   final_state="COMPLETED", exit_code=0, job_sha256="a" * 64, reference_sha256="a" * 64)
    ram.checks = checks.evaluate(ram, simulated=False, hold_at=jobs.HOLD_AT)
    ram.settle()
    freeze = Scenario("transparent", status="skipped", skip_reason="driver 550.54 predates the checkpoint API")
    gpu = GpuResult(0, "NVIDIA H100", "GPU-1234", scenarios=[ram, freeze],
                    plain_copy=PlainCopy("pinned host<->device copies", 4 * GiB, 0.16, 0.17, 1.1))
    found = Report(simulated=False, size_bytes=4 * GiB, daemon="1 NVIDIA GPU(s) via NVML", gpus=[gpu])
    out = io.StringIO()
    report.render(found, Console(file=out, width=250, highlight=False))
    text = out.getvalue()
    assert found.ok and "PASSED" in text and "SIMULATED" not in text
    assert "21.5 GB/s, 0.80× pinned" in text                     # 4 GiB in 0.2 s beside 4 GiB in 0.16 s
    assert "skipped: driver 550.54 predates the checkpoint API" in text
    assert "device→host 0.16 s (26.8 GB/s)" in text
    # A note says what a failure most likely means: beside a PASS it would claim the opposite of
    # what was measured (seen on an H100: "NVML does not see the job's memory" next to 4.8 GiB seen)
    assert "does not see" not in text
    d = json.loads(json.dumps(found.to_json()))
    assert d["simulated"] is False and d["gpus"][0]["scenarios"][0]["bandwidth"]["park_vs_pinned"] == pytest.approx(0.8)
