"""The selftest's report on a terminal: a banner on simulated GPUs, per GPU a table of the
scenarios' figures, then every check with its numbers and PASS/FAIL, and one verdict line.
`--json` prints `Report.to_json()` instead (the banner then goes to stderr)."""
from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpuswap.jobs import format_size
from gpuswap.selftest.measure import PlainCopy
from gpuswap.selftest.results import SIMULATED_NOTE, GpuResult, Report, Scenario, bandwidths
from gpuswap.terminal import plain

BANNER = "SIMULATED GPUs: NOTHING REAL WAS MEASURED"
SIM_TIMES = "park and resume times (sim) are of simulated moves: they are not bandwidths, and no GB/s is given"


def banner(console: Console) -> None:
    console.print(Text(f"*** {BANNER} ***", style="bold red"))
    console.print(plain(SIMULATED_NOTE, "red"))


def render(report: Report, console: Console) -> None:
    if report.simulated:
        banner(console)
    tr = report.transparent
    console.print(plain(f"gpuswap selftest: {report.daemon or 'no daemon'}; --size {format_size(report.size_bytes)}; "
                        f"private daemon in {report.home or '-'} ({report.home_filesystem or '?'}); transparent "
                        f"parking {'available' if tr.get('available') else 'unavailable'}: {tr.get('description', '?')}",
                        "bold"))
    for g in report.gpus:
        _gpu(g, report.simulated, console)
    _checks(report, console)
    if report.error:
        console.print(plain(f"selftest stopped: {report.error}", "red"))
    n = sum(1 for g in report.gpus for _, c in g.all_checks() if c.ok is not None)
    na = sum(1 for g in report.gpus for _, c in g.all_checks() if c.ok is None)
    failed = report.failed
    sim = " (SIMULATED: nothing real was measured)" if report.simulated else ""
    if report.ok:
        console.print(Text(f"PASSED: all {n} checks hold" + (f", {na} n/a" if na else "") + sim, style="bold green"))
    else:
        console.print(Text(f"FAILED: {len(failed)} of {n} checks fail" + sim, style="bold red"))
        for line in failed:
            console.print(plain(f"  {line}", "red"))
    if report.simulated:
        banner(console)


def _gpu(g: GpuResult, simulated: bool, console: Console) -> None:
    label = f"GPU {'sim ' if g.simulated else ''}{g.index}: {g.name}" + (" [SIMULATED]" if g.simulated else f" ({g.uuid})")
    t = Table(title=label, title_justify="left", box=None, pad_edge=False)
    cols = ("SCENARIO", "RESULT", "NVML BEFORE → DURING → AFTER", "FLOOR", "PARKED", "HOST RAM", "PARK", "RESUME",
            "FINAL PARAMETERS")
    for c in cols:
        t.add_column(c, overflow="fold")
    for s in g.scenarios:
        if s.status == "skipped":
            t.add_row(plain(s.title), plain("skipped", "yellow"), *[plain("-")] * 7)
            continue
        bw = bandwidths(s, g.plain_copy, simulated)
        t.add_row(plain(s.title), plain(s.status.upper(), "green" if s.status == "passed" else "bold red"),
                  plain(" → ".join(_size(v) for v in (s.nvml_before, s.nvml_during, s.nvml_after))),
                  plain(_size(s.floor) if s.key == "ram" else "-"), plain(_size(s.parked_bytes)),
                  plain(_ram(s)), plain(_move(s.park_s, bw.get("park_gbps"), bw.get("park_vs_pinned"), simulated)),
                  plain(_move(s.resume_s, bw.get("resume_gbps"), bw.get("resume_vs_pinned"), simulated)),
                  plain("equal" if s.job_sha256 and s.job_sha256 == s.reference_sha256 else "DIFFERENT"
                        if s.job_sha256 else "-"))
    console.print(t)
    for s in g.scenarios:
        if s.status == "skipped":      # a skip is not a failure, but its reason must be read
            console.print(plain(f"  {s.title}: skipped: {s.skip_reason}", "yellow"))
    if simulated:
        console.print(plain(f"  {SIM_TIMES}", "yellow"))
    if g.plain_copy is not None:
        console.print(plain("  " + _copy(g.plain_copy)))


def _checks(report: Report, console: Console) -> None:
    t = Table(title="checks", title_justify="left", box=None, pad_edge=False)
    for c in ("GPU", "SCENARIO", "CHECK", "VALUE", "LIMIT", "RESULT"):
        t.add_column(c, overflow="fold")
    for g in report.gpus:
        for where, c in g.all_checks():
            verdict = ("n/a", "yellow") if c.ok is None else ("PASS", "green") if c.ok else ("FAIL", "bold red")
            # a note says why n/a, or what a failure likely means: never shown beside a PASS
            value = c.value + (f" — {c.note}" if c.note and c.ok is not True else "")
            t.add_row(plain(f"{'sim ' if g.simulated else ''}{g.index}"), plain(where), plain(c.name), plain(value),
                      plain(c.limit), plain(*verdict))
    console.print(t)


def _size(n: Optional[int]) -> str:
    return "?" if n is None else format_size(n)


def _ram(s: Scenario) -> str:
    """The job's RSS during the park and after the resume, each less before."""
    def signed(d: Optional[int]) -> str:
        return "?" if d is None else f"{'+' if d >= 0 else ''}{format_size(d)}"

    during = "none (process exited)" if s.key == "disk" else f"{signed(s.rss_delta)} during"
    return f"{during}, {signed(s.rss_kept)} after (RSS)"


def _move(seconds: Optional[float], gbps: Optional[float], ratio: Optional[float], simulated: bool) -> str:
    if seconds is None:
        return "not reported"
    if simulated:
        return f"{seconds:.2f} s (sim)"
    rate = f", {gbps:.1f} GB/s" if gbps else ""
    vs = f", {ratio:.2f}× pinned" if ratio else ""
    return f"{seconds:.2f} s{rate}{vs}"


def _copy(c: PlainCopy) -> str:
    if c.error:
        return f"plain copy: {c.error}"
    if c.simulated:
        return (f"plain copy for comparison: {c.kind} of {format_size(c.nbytes)}: {c.d2h_s or 0:.4f} s "
                f"(a host memcpy, not a GPU bandwidth)")
    d2h = c.nbytes / c.d2h_s / 1e9 if c.d2h_s else 0.0
    h2d = c.nbytes / c.h2d_s / 1e9 if c.h2d_s else 0.0
    return (f"plain copy for comparison: {c.kind} of {format_size(c.nbytes)}: device→host {c.d2h_s or 0:.2f} s "
            f"({d2h:.1f} GB/s), host→device {c.h2d_s or 0:.2f} s ({h2d:.1f} GB/s), best of 3; "
            f"allocating and pinning the host buffer {c.alloc_s or 0:.2f} s")
