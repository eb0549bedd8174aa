"""What a selftest run found: per GPU, per scenario, every figure and every check. `--json` prints
`Report.to_json()`; the table is drawn from the same objects (report.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from gpuswap.selftest.measure import PlainCopy

SCENARIOS = {"ram": "cooperative RAM park", "disk": "cooperative disk park",
             "transparent": "transparent freeze (unmodified script under sh)"}


@dataclass
class Check:
    name: str
    ok: Optional[bool]        # None: does not apply here (shown as n/a, never a failure)
    value: str                # the figures it was decided on
    limit: str = ""           # the threshold, in words
    note: str = ""            # why n/a, or what a failure most likely means


@dataclass
class Scenario:
    key: str                                   # ram | disk | transparent
    title: str = ""
    status: str = "failed"                     # passed | failed | skipped
    skip_reason: str = ""
    error: str = ""                            # what stopped it before the end
    job_id: Optional[int] = None
    final_state: Optional[str] = None
    exit_code: Optional[int] = None
    parked: Optional[str] = None               # the tier the daemon reported while paused
    mechanism: Optional[str] = None            # cooperative | transparent
    parked_bytes: Optional[int] = None
    # NVML memory of the job's process tree (bytes), and the context floor it is compared with
    nvml_before: Optional[int] = None
    nvml_during: Optional[int] = None
    nvml_after: Optional[int] = None
    nvml_processes_before: list[tuple[int, Optional[int]]] = field(default_factory=list)
    nvml_processes_during: list[tuple[int, Optional[int]]] = field(default_factory=list)
    floor: Optional[int] = None
    # host memory: the job tree's VmRSS (what the check uses) and MemAvailable (whole machine)
    rss_before: Optional[int] = None
    rss_during: Optional[int] = None
    rss_after: Optional[int] = None
    mem_available_drop: Optional[int] = None
    # the daemon's timing of the move (from the job's events) and what the selftest saw end to end
    park_s: Optional[float] = None
    resume_s: Optional[float] = None
    park_end_to_end_s: Optional[float] = None
    resume_end_to_end_s: Optional[float] = None
    # processes
    job_pid: Optional[int] = None              # the held process (cooperative: the job itself)
    job_pid_after: Optional[int] = None        # after a disk park: the restarted process
    shell_pid: Optional[int] = None            # transparent: the shell the CUDA process is a child of
    shell_name: Optional[str] = None
    restarted_at_step: Optional[int] = None
    # results
    job_sha256: Optional[str] = None
    reference_sha256: Optional[str] = None
    job_device: Optional[str] = None
    reference_device: Optional[str] = None
    checks: list[Check] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.title = self.title or SCENARIOS.get(self.key, self.key)

    @property
    def rss_delta(self) -> Optional[int]:
        """Host RAM the park took: the job tree's RSS during it, less before."""
        if self.rss_before is None or self.rss_during is None:
            return None
        return self.rss_during - self.rss_before

    @property
    def rss_kept(self) -> Optional[int]:
        """Host RAM still held after the resume (no check: shown, so a cache that keeps the
        parked bytes resident after the job resumed is seen)."""
        if self.rss_before is None or self.rss_after is None:
            return None
        return self.rss_after - self.rss_before

    def settle(self) -> None:
        """The status from the checks (a skipped scenario stays skipped)."""
        if self.status != "skipped":
            self.status = "passed" if self.checks and all(c.ok is not False for c in self.checks) else "failed"


@dataclass
class GpuResult:
    index: int
    name: str = ""
    uuid: str = ""
    simulated: bool = False
    floor: Optional[int] = None                # NVML of the floor probe's tree
    floor_error: str = ""
    plain_copy: Optional[PlainCopy] = None
    checks: list[Check] = field(default_factory=list)     # about the GPU itself (room, placement)
    scenarios: list[Scenario] = field(default_factory=list)

    def all_checks(self) -> list[tuple[str, Check]]:
        return [("gpu", c) for c in self.checks] + [(s.key, c) for s in self.scenarios for c in s.checks]


@dataclass
class Report:
    simulated: bool
    size_bytes: int
    home: str = ""
    home_filesystem: str = ""
    daemon: str = ""                           # the private daemon's description of its GPUs
    transparent: dict[str, Any] = field(default_factory=dict)
    gpus: list[GpuResult] = field(default_factory=list)
    error: str = ""                            # what stopped the whole run

    @property
    def failed(self) -> list[str]:
        """'GPU 0 ram: <check>' for every check that does not hold, and the run's own error."""
        out = [f"GPU {g.index} {where}: {c.name}" for g in self.gpus for where, c in g.all_checks() if c.ok is False]
        return out + ([f"selftest: {self.error}"] if self.error else [])

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.gpus) and all(
            s.status != "failed" for g in self.gpus for s in g.scenarios)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"], d["failed_checks"] = self.ok, self.failed
        d["note"] = SIMULATED_NOTE if self.simulated else "measured on real GPUs"
        for g, gd in zip(self.gpus, d["gpus"]):
            for s, sd in zip(g.scenarios, gd["scenarios"]):
                sd["rss_delta"], sd["rss_kept_after_resume"] = s.rss_delta, s.rss_kept
                sd["bandwidth"] = bandwidths(s, g.plain_copy, self.simulated)
        return d


SIMULATED_NOTE = ("SIMULATED GPUs: nothing real was measured. No GPU memory was moved; the NVML "
                  "figures are the simulated device's; the timings are of simulated moves and are "
                  "not bandwidths.")


def bandwidths(s: Scenario, copy: Optional[PlainCopy], simulated: bool) -> dict[str, Any]:
    """GB/s of the park and resume and of the plain copy of the same bytes, and their ratios;
    on simulated GPUs none (a simulated move's time is no bandwidth), with the reason."""
    if simulated:
        return {"note": "simulated: timings are not bandwidths"}
    n = s.parked_bytes or 0

    def rate(seconds: Optional[float], nbytes: int) -> Optional[float]:
        return nbytes / seconds / 1e9 if seconds and nbytes else None

    park, resume = rate(s.park_s, n), rate(s.resume_s, n)
    d2h = rate(copy.d2h_s, copy.nbytes) if copy else None
    h2d = rate(copy.h2d_s, copy.nbytes) if copy else None
    same_path = s.key != "disk"       # a disk park writes a file: the copy is no yardstick for it
    return {"park_gbps": park, "resume_gbps": resume, "pinned_d2h_gbps": d2h, "pinned_h2d_gbps": h2d,
            "park_vs_pinned": park / d2h if same_path and park and d2h else None,
            "resume_vs_pinned": resume / h2d if same_path and resume and h2d else None}
