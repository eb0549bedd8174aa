"""How records look on a terminal (rich tables). `--json` bypasses all of this (cli/main.py prints
the record as it came, without importing rich).

Everything shown here that a user or the machine chose (job names, commands, users, reasons,
paths, GPU names) goes to rich as a `Text`, never as a markup string: a job named "[/x]" would
otherwise crash the table with a MarkupError, and one named "[bold]" would silently restyle it.
Only literals written in this module carry markup.
"""
from __future__ import annotations

import shlex
import time
from typing import Any

from rich.table import Table
from rich.text import Text

from gpuswap.jobs import format_size
from gpuswap.terminal import console, plain, residue_text, state_text

SIMULATED_NOTE = "SIMULATED GPUs — no real GPU is in use"


def duration(seconds: float | None) -> str:
    """"4.2s", "45s", "3m 05s", "2h 10m", "7 days", "1 day 3h": the two largest units, a zero second
    one dropped (the dashboard's `dur` in app.js says the same)."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{s}s"

    def two(big: int, unit: str, small: int, small_unit: str) -> str:
        return f"{big}{unit} {small:02d}{small_unit}" if small else f"{big}{unit}"

    if s < 3600:
        return two(s // 60, "m", s % 60, "s")
    if s < 86400:
        return two(s // 3600, "h", s % 3600 // 60, "m")
    days, hours = s // 86400, s % 86400 // 3600
    return f"{days} day{'' if days == 1 else 's'}" + (f" {hours}h" if hours else "")


def reason_text(j: dict[str, Any]) -> str:
    """Why a waiting job waits ("SwitchCap: waiting for 1 GPU: ..."), the policy's own reason, as
    `top` and the dashboard show it; for any other job, its last event."""
    if j.get("pending_reason"):
        return f"{j['pending_reason']}: {j.get('pending_reason_text') or ''}".rstrip(": ")
    return j.get("reason") or ""


def rank_rows(j: dict[str, Any]) -> list[tuple[str, str]]:
    """A multi-rank job's ranks, one row each: 'rank 1', 'parked, pid 4242, 21.1 KiB on its GPU'."""
    rows = []
    for r in j.get("ranks") or []:
        where = "" if r.get("connected") else ", disconnected"
        rows.append((f"rank {r.get('rank')}", f"{r.get('state')}, pid {r.get('pid') or '-'}{where}, "
                                              f"{format_size(r.get('device_bytes') or 0)} on its GPU"))
    return rows


def gpu_list(j: dict[str, Any]) -> str:
    """'1 [0]', or '1 [sim 0]' on simulated GPUs: GPU indices never pass for real ones; in a pool
    (docs/ray.md) the node leads them: '1 [sim node-b:0]'."""
    gpus = ",".join(str(g) for g in j.get("assigned_gpus") or [])
    if not gpus:
        return str(j["gpus"]) + (f" [{j['node']}]" if j.get("node") and not j.get("ended") else "")
    where = f"{j['node']}:" if j.get("node") else ""
    return f"{j['gpus']} [{'sim ' if j.get('gpus_simulated') else ''}{where}{gpus}]"


def jobs_table(jobs: list[dict[str, Any]]) -> None:
    if not jobs:
        console.print("no jobs")
        return
    if any(j.get("gpus_simulated") for j in jobs):
        console.print(plain(SIMULATED_NOTE, "bold"))
    t = Table(box=None, pad_edge=False)
    for col in ("ID", "NAME", "USER", "STATE", "PRIO", "GPUS", "STEP", "IN STATE", "LEFT", "REASON"):
        t.add_column(col, no_wrap=col not in ("REASON",))
    for j in jobs:
        t.add_row(plain(j["id"]), plain(j["name"]), plain(j["user"]), plain(state_text(j)), plain(j["priority"]),
                  plain(gpu_list(j)), plain("-" if j.get("step") is None else j["step"]),
                  plain(duration(j.get("time_in_state_s"))), plain(left_text(j)), plain(reason_text(j)))
    console.print(t)


def left_text(j: dict[str, Any]) -> str:
    """`ls`' LEFT: the run time its estimate says a live job still needs, "outlived" once it ran
    past it, "-" without an estimate or once ended (`show` says where the estimate came from)."""
    if j.get("estimate_s") is None or j.get("ended"):
        return "-"
    if j.get("estimate_outlived"):
        return "outlived"
    return duration(j.get("estimate_left_s"))


def estimate_text(j: dict[str, Any]) -> str:
    """'4h from --time; 1.2h left', '2.1h from 5 earlier runs of alice/train; outlived', 'none'."""
    text = j.get("estimate") or "none"
    if j.get("estimate_s") is None or j.get("ended"):
        return text
    if j.get("estimate_outlived"):
        return f"{text}; outlived (ranked by attained service)"
    left = j.get("estimate_left_s")
    return f"{text}; {duration(left)} left" if left is not None else text


def job_detail(j: dict[str, Any]) -> None:
    assigned = ",".join(str(g) for g in j.get("assigned_gpus") or []) or "-"
    if j.get("node"):
        assigned = f"{assigned} on node {j['node']}"
    sim = " (SIMULATED GPUs — no real GPU is in use)" if j.get("gpus_simulated") else ""
    rows = [
        ("job", f"{j['id']} ({j['name']})"), ("user", j["user"]), ("state", state_text(j)),
        ("reason", reason_text(j) or "-"), ("priority", j["priority"] + ("" if j["preemptible"] else ", no-preempt")),
        ("gpus", f"{j['gpus']} requested; assigned {assigned}{sim}"),
        ("memory", f"declared {format_size(j['mem_bytes'])}; reported {format_size(j['device_bytes'])}"),
        ("parked", (f"{j['parked']} ({format_size(j['parked_bytes'])})" if j.get("parked") else "-")
         + (f"; {residue_text(j)} (CUDA context and memory not attached)" if j.get("residue") else "")),
        *rank_rows(j),
        ("exit code", "-" if j.get("exit_code") is None else str(j["exit_code"])),
        ("service", f"{duration(j['run_s'])} running, {duration(j['switch_s'])} switching, "
                    f"{j['preemptions']} preemption(s)"),
        ("estimate", estimate_text(j)),
        ("command", shlex.join(j["argv"])), ("cwd", j["cwd"]), ("log", j.get("log", "-")),
    ]
    t = Table(box=None, show_header=False, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows:
        t.add_row(k, plain(v))
    console.print(t)
    ev = Table(box=None, pad_edge=False, title="events" + (" (GPUs are simulated)" if sim else ""),
               title_justify="left")
    for col in ("TIME", "STATE", "REASON"):
        ev.add_column(col)
    for e in j.get("events", []):
        ev.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"])), plain(e["state"]),
                   plain(e["reason"]))
    console.print(ev)


def gpus_table(info: dict[str, Any]) -> None:
    banner = SIMULATED_NOTE if info["simulated"] else info["description"]
    console.print(Text.assemble((banner, "bold"), f"   policy: {info['policy']}"))
    t = Table(box=None, pad_edge=False)
    pool = any(g.get("node") for g in info["gpus"])      # a pool's GPUs name their node (docs/ray.md)
    for col in (("NODE",) if pool else ()) + ("GPU", "NAME", "MEMORY USED / TOTAL", "JOBS"):
        t.add_column(col)
    for g in info["gpus"]:
        name = g["name"] + (" (simulated)" if g["simulated"] and "simulated" not in g["name"] else "")
        jobs = ", ".join(f"{j['id']} {j['name']} {j['state']}".strip()
                         + (f" (parked in RAM, keeps {format_size(j['residue_bytes'])})"
                            if j.get("residue_bytes") else "")
                         for j in g["jobs"]) or "free"
        t.add_row(*((plain(g.get("node") or "-"),) if pool else ()), plain(g["index"]), plain(name),
                  plain(f"{format_size(g['mem_used'])} / {format_size(g['mem_total'])}"), plain(jobs))
    console.print(t)
    if info.get("ram_nodes"):      # a pool: each node parks in its own RAM
        for r in info["ram_nodes"]:
            console.print(plain(f"host RAM parked on {r['node']}: {format_size(r['parked'])} of a "
                                f"{format_size(r['budget'])} budget"))
    else:
        console.print(plain(f"host RAM parked: {format_size(info['ram_parked'])} of a {format_size(info['ram_budget'])} budget"))
    tr = info.get("transparent") or {}
    state = "available" if tr.get("available") else "unavailable"
    console.print(plain(f"transparent parking: {state} — {tr.get('description', '?')}; disk tier via CRIU: {tr.get('criu')}"))
    per_node = info.get("node_bandwidths")
    if isinstance(per_node, dict):         # a pool: each node moves state at its own speed
        for node, bw in sorted(per_node.items()):
            _bandwidths(bw or {}, f" on {node}")
    else:
        _bandwidths(info.get("bandwidths") or {}, "")


def _bandwidths(bw: dict, where: str) -> None:
    """The switch-cost figures, each with its source (`where`: a pool's node)."""
    if bw:
        console.print(plain(f"switch bandwidths{where}: " + ", ".join(
            f"{name.removesuffix('_bps').replace('_', ' ')} {v['bytes_per_s'] / 1e9:.1f} GB/s ({v['source']})"
            for name, v in bw.items() if "bytes_per_s" in v)))
        group = [(name.removesuffix("_s").replace("_", " "), v) for name, v in bw.items() if "seconds" in v]
        if group:
            console.print(plain(f"multi-rank switches{where}: " + ", ".join(
                f"{name} {v['seconds']:.2f} s ({v['source']})" for name, v in group)))
