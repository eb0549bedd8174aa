"""The selftest's checks: each scenario's figures against explicit thresholds.

Thresholds (docs/selftest.md explains each):
  margin(x)   = 256 MiB + 2 % of x: what NVML may differ by between two looks at "the same" memory
                (the CUDA context, lazily loaded kernels, the allocator's 2 MiB granularity)
  floor       = NVML memory of a floor probe: the same cooperative job holding a few KiB of state,
                held at the same point; what a job keeps on the GPU with its tensors parked
  RAM park    : NVML during <= floor + margin(parked); after within margin(before) of before;
                host RAM (job tree's RSS during - before) <= 1.25 x parked bytes;
                on real GPUs, NVML before >= floor + 0.9 x parked (NVML sees the job's tensors,
                else "during" proves nothing)
  disk park   : no NVML memory of the job while parked; restarted from its checkpoint in a new
                process; after within margin(before) of before
  freeze      : NVML lists the script's own process, a child of the shell; no NVML memory of the
                job while frozen; after within margin(before); host RAM <= 1.25 x parked bytes
  every one   : the job ended COMPLETED (exit 0); its final parameters' sha256 equals the
                uninterrupted reference's; the daemon timed the park and the resume
"""
from __future__ import annotations

from typing import Optional

from gpuswap.jobs import format_size
from gpuswap.selftest.results import Check, Scenario

MARGIN_BYTES = 256 * 2**20
MARGIN_FRACTION = 0.02
HOST_RAM_FACTOR = 1.25
SEEN_FRACTION = 0.9


def margin(x: Optional[int]) -> int:
    return MARGIN_BYTES + int(MARGIN_FRACTION * (x or 0))


def _size(n: Optional[int]) -> str:
    return "not measured" if n is None else format_size(n)


def _unmeasured(name: str, *values: Optional[int]) -> Optional[Check]:
    if any(v is None for v in values):
        return Check(name, False, "not measured",
                     note="NVML gave no per-process figure (or the run stopped before this point)")
    return None


def evaluate(s: Scenario, simulated: bool, hold_at: int) -> list[Check]:
    """Every check of one scenario that ran (a skipped one has none)."""
    out: list[Check] = []
    if s.error:
        out.append(Check("scenario ran to the end", False, s.error))
    out += {"ram": _ram, "disk": _disk, "transparent": _transparent}[s.key](s, simulated, hold_at)
    out.append(Check("park and resume timed by the daemon", s.park_s is not None and s.resume_s is not None,
                     f"park {_secs(s.park_s)}, resume {_secs(s.resume_s)}",
                     "both moves' seconds in the job's events"))
    out.append(Check("job ended COMPLETED", s.final_state == "COMPLETED" and s.exit_code == 0,
                     f"{s.final_state or 'not ended'} (exit {s.exit_code})", "COMPLETED, exit 0"))
    same = s.job_sha256 is not None and s.job_sha256 == s.reference_sha256
    devices = f" (job on {s.job_device}, reference on {s.reference_device})"
    out.append(Check("final parameters bitwise equal to the uninterrupted run", same,
                     f"sha256 {(s.job_sha256 or 'none')[:16]} vs {(s.reference_sha256 or 'none')[:16]}" + devices,
                     "equal sha256", "" if same or s.job_device == s.reference_device
                     else "the job and its reference ran on different kinds of device"))
    return out


def _secs(v: Optional[float]) -> str:
    return "not reported" if v is None else f"{v:.2f} s"


def _after(s: Scenario, what: str) -> Check:
    name = f"NVML after {what} ≈ before"
    return _unmeasured(name, s.nvml_before, s.nvml_after) or Check(
        name, abs(s.nvml_after - s.nvml_before) <= margin(s.nvml_before),     # type: ignore[operator]
        f"{_size(s.nvml_before)} before, {_size(s.nvml_after)} after",
        f"within {_size(margin(s.nvml_before))}")


def _host_ram(s: Scenario) -> Check:
    name = f"host RAM used ≤ {HOST_RAM_FACTOR:g} × parked bytes"
    d, parked = s.rss_delta, s.parked_bytes
    if d is None or parked is None:
        return Check(name, False, "not measured")
    return Check(name, d <= HOST_RAM_FACTOR * parked,
                 f"job RSS +{format_size(d)} for {format_size(parked)} parked" if d >= 0 else
                 f"job RSS {format_size(d)} for {format_size(parked)} parked",
                 f"≤ {format_size(HOST_RAM_FACTOR * parked)} (RSS of the job's processes, during - before)")


def _ram(s: Scenario, simulated: bool, hold_at: int) -> list[Check]:
    out = [Check("parked in RAM by the job's runtime", s.parked == "ram" and s.mechanism == "cooperative",
                 f"parked {s.parked or '-'} ({s.mechanism or '-'}), {_size(s.parked_bytes)}", "ram, cooperative")]
    name = f"NVML sees the job's tensors before the park (≥ floor + {SEEN_FRACTION:g} × parked)"
    # Simulated GPUs too: the runtime registers its process with the simulated device as the context
    # floor plus its attached bytes (runtime/simdevice.py), as NVML lists a real job's process.
    out.append(_unmeasured(name, s.nvml_before, s.floor, s.parked_bytes) or Check(
        name, s.nvml_before >= s.floor + SEEN_FRACTION * s.parked_bytes,            # type: ignore[operator]
        f"{_size(s.nvml_before)} before; floor {_size(s.floor)}, parked {_size(s.parked_bytes)}",
        f"≥ {_size(int(s.floor + SEEN_FRACTION * s.parked_bytes))}",               # type: ignore[operator]
        "NVML does not see the job's memory (in a container without the host's PID namespace NVML's "
        "pids are not the job's)"))
    name = "NVML during the park ≤ context floor + margin"
    out.append(_unmeasured(name, s.nvml_during, s.floor) or Check(
        name, s.nvml_during <= s.floor + margin(s.parked_bytes),                      # type: ignore[operator]
        f"{_size(s.nvml_during)} during; floor {_size(s.floor)}",
        f"≤ {_size(s.floor + margin(s.parked_bytes))}"))                              # type: ignore[operator]
    out.append(_after(s, "the resume"))
    out.append(_host_ram(s))
    return out


def _disk(s: Scenario, simulated: bool, hold_at: int) -> list[Check]:
    out = [Check("parked to disk (checkpoint, exit 75, requeued)", s.parked == "disk",
                 f"parked {s.parked or '-'}, checkpoint {_size(s.parked_bytes)}", "disk")]
    name = "no GPU memory of the job while parked on disk"
    out.append(_unmeasured(name, s.nvml_during) or Check(
        name, s.nvml_during == 0 and not s.nvml_processes_during,
        f"{_size(s.nvml_during)} in {len(s.nvml_processes_during)} listed process(es)", "0, none listed"))
    new_process = s.job_pid_after is not None and s.job_pid_after != s.job_pid
    out.append(Check("restarted from its checkpoint in a new process",
                     new_process and s.restarted_at_step == hold_at,
                     f"restarted at step {s.restarted_at_step}, pid {s.job_pid} → {s.job_pid_after}",
                     f"step {hold_at}, another pid"))
    out.append(_after(s, "the restart"))
    return out


def _transparent(s: Scenario, simulated: bool, hold_at: int) -> list[Check]:
    listed = {pid: b for pid, b in s.nvml_processes_before}
    child = (s.job_pid in listed and (listed[s.job_pid] or 0) > 0 and s.shell_pid is not None
             and s.shell_pid != s.job_pid)
    out = [Check("NVML lists the script's process, a child of the shell", child,
                 f"CUDA process {s.job_pid} ({_size(listed.get(s.job_pid or -1))}), parent {s.shell_name or '?'} "
                 f"{s.shell_pid}; NVML lists {sorted(listed) or 'none'} in the job's tree",
                 "the script's pid listed with memory; its parent the shell")]
    out.append(Check("frozen by the driver", s.parked == "ram" and s.mechanism == "transparent",
                     f"parked {s.parked or '-'} ({s.mechanism or '-'}), {_size(s.parked_bytes)}", "ram, transparent"))
    name = "no GPU memory of the job while frozen"
    out.append(_unmeasured(name, s.nvml_during) or Check(
        name, s.nvml_during == 0 and not s.nvml_processes_during,
        f"{_size(s.nvml_during)} in {len(s.nvml_processes_during)} listed process(es)", "0, none listed"))
    out.append(_after(s, "the thaw"))
    if simulated:   # the real driver copies device memory into the process's host memory; ours has none to copy
        out.append(Check(f"host RAM used ≤ {HOST_RAM_FACTOR:g} × parked bytes", None, "not measured",
                         note="the simulated driver makes no host copy of device memory: nothing to measure"))
    else:
        out.append(_host_ram(s))
    return out
