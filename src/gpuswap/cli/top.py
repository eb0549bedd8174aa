"""`gpuswap top`: the dashboard's picture in the terminal, refreshed every second (rich Live).

It renders `GET /v1/overview`, the same record the web dashboard uses, so both say the same thing.
`q` or Ctrl-C quits; `--once` prints one frame and exits (for scripts, tests and pipes).
No daemon at the start exits 69 like every verb; once the view is up, a daemon that goes away
(restarted, upgraded) is shown as a banner over the last picture and retried until it is back.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import time
from typing import Any, Callable, Iterator

from rich.console import Group
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gpuswap.api.client import ClientError
from gpuswap.cli.argtypes import period
from gpuswap.cli.render import duration, plain, reason_text
from gpuswap.terminal import PipeConsole
from gpuswap.exitcodes import EX_UNAVAILABLE
from gpuswap.jobs import format_size

STATE_STYLE = {"RUNNING": "green", "PAUSED": "yellow", "PAUSING": "yellow", "RESUMING": "yellow",
               "PENDING": "bright_black", "FAILED": "red", "CANCELLED": "red", "COMPLETED": "bright_black"}


def register(sub: Any, client: Callable[[], Any]) -> None:
    s = sub.add_parser("top", help="live full-screen view of GPUs, jobs, parked memory and fair share")
    s.add_argument("--once", action="store_true", help="print one frame and exit")
    s.add_argument("--interval", type=period, default=1.0, metavar="S",
                   help="refresh period in seconds, at least 0.2 (default 1 s)")
    s.set_defaults(func=lambda a: run(a, client))


def _where(j: dict[str, Any]) -> str:
    if j["state"] == "PAUSED":
        return {"ram": "RAM", "disk": "disk"}.get(j["tier"] or "", "GPU (SIGSTOP)" if j["stopped"] else "-")
    return "GPU" if j["state"] in ("RUNNING", "PAUSING", "RESUMING") else "-"


def _kept(g: dict[str, Any]) -> list[str]:
    """The jobs parked in RAM that keep memory on this GPU: ['3 (parked, keeps 512.0 MiB)']."""
    return [f"{r['job']} (parked, keeps {format_size(r['bytes'])})" for r in g.get("residue") or []]


def _gpu(node: Any, index: Any) -> str:
    """A GPU as `gpuswap gpus` names it: its index, in a pool `node:index` (docs/ray.md)."""
    return f"{node}:{index}" if node else str(index)


def _parked(j: dict[str, Any]) -> str:
    """Its parked size, and what stays on its GPUs: '1.3 GiB; 512.0 MiB stays on GPU 0'."""
    size = format_size(j["parked_bytes"]) if j["parked_bytes"] else "size unknown" if j["tier"] else "-"
    return size + "".join(f"; {format_size(r['bytes'])} stays on GPU {_gpu(j.get('node'), r['gpu'])}"
                          for r in j.get("residue") or [])


def frame(o: dict[str, Any], live: bool = True) -> Group:
    """One screenful from an overview record (`live`: the interactive view, which `q` quits)."""
    # Names, users, reasons and commands are the users' own words: they go to rich as `Text`
    # (render.plain), never as markup, so "[/x]" cannot crash the view nor "[bold]" restyle it.
    head = Text.assemble(("gpuswap", "bold blue"), "  ",
                         ("SIMULATED GPUs  ", "bold yellow") if o["simulated"] else "",
                         plain(f"{o['description']} · policy {o['policy']} · you: {o['caller']['user']}"
                               f"{' (admin)' if o['caller']['admin'] else ''} · "
                               f"{time.strftime('%H:%M:%S', time.localtime(o['time']))}"))
    gpus = Table(box=None, pad_edge=False, expand=True)
    for col in ("GPU", "MEMORY", "", "JOBS"):
        gpus.add_column(col, ratio=2 if col == "" else None)
    for g in o["gpus"]:
        gpus.add_row(plain(f"{_gpu(g.get('node'), g['index'])}{' (sim)' if g['simulated'] else ''}"),
                     plain(f"{format_size(g['mem_used'])} / {format_size(g['mem_total'])}"),
                     ProgressBar(total=max(g["mem_total"], 1), completed=g["mem_used"], width=30),
                     plain(", ".join([str(i) for i in g["jobs"]] + _kept(g)) or "free"))
    jobs = Table(box=None, pad_edge=False, expand=True)
    for col in ("ID", "NAME", "OWNER", "PRIO", "STATE", "WHERE", "PARKED", "IN STATE", "REASON"):
        jobs.add_column(col, no_wrap=col != "REASON", overflow="fold")
    for j in o["jobs"]:
        reason = reason_text(j)
        jobs.add_row(plain(j["id"]), plain(j["name"] or "(other)"), plain(j["user"]), plain(j["priority"]),
                     plain(j["state"] + (" (held)" if j["held"] else ""), STATE_STYLE.get(j["state"], "")),
                     plain(_where(j)),
                     plain(_parked(j)),
                     plain(duration(j["time_in_state_s"])), plain(reason))
    ram = o["ram"]
    ram_line = Table.grid(padding=(0, 1))
    ram_line.add_row("host RAM parked", ProgressBar(total=max(ram["budget"], 1), completed=ram["parked"], width=30),
                     plain(f"{format_size(ram['parked'])} of {format_size(ram['budget'])}; "
                           f"disk: {format_size(o['parked_bytes']['disk'])}"))
    fair = Table(box=None, pad_edge=False)
    for col in ("USER", "USAGE (GPU·s, decayed)", "SHARE", "GPUS NOW"):
        fair.add_column(col)
    for u in o["fair_share"]:
        fair.add_row(plain(u["user"]), plain(f"{u['usage_gpu_s']:.1f}"), plain(f"{100 * u['share']:.1f}%"),
                     plain(u["gpus_now"]))
    parts = [head, Panel(gpus, title="GPUs", title_align="left"), ram_line,
             Panel(jobs, title="jobs", title_align="left"), Panel(fair, title="fair share", title_align="left")]
    return Group(*parts, *([Text("q quits", style="bright_black")] if live else []))


def unavailable(last: Group, err: ClientError, since: float) -> Group:
    """The last picture, under a banner saying the daemon cannot be reached since `since`.

    Its state is durable, so a restart loses nothing the view shows: better to keep the screen
    and say so than to quit under the user's eyes."""
    banner = Text(f" daemon unavailable — retrying (since {time.strftime('%H:%M:%S', time.localtime(since))}): "
                  f"{err} ", style="bold white on red")
    return Group(banner, last)


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[], str]]:
    """Unbuffered single keys from a terminal stdin; nothing when stdin is not one."""
    if not sys.stdin.isatty():
        yield lambda: ""
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield lambda: os.read(fd, 1).decode(errors="ignore") if select.select([fd], [], [], 0)[0] else ""
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def run(a: argparse.Namespace, client: Callable[[], Any]) -> int:
    from rich.live import Live

    c = client()
    console = PipeConsole()
    if a.once or not console.is_terminal:
        PipeConsole(width=console.width if console.is_terminal else 160).print(frame(c.get("/v1/overview"), live=False))
        return 0
    interval = max(0.2, a.interval)
    last = frame(c.get("/v1/overview"))   # no daemon before anything was shown: exit 69
    down_since: float | None = None
    with _keys() as key, Live(last, console=console, screen=True, auto_refresh=False) as live:
        next_at = time.monotonic() + interval
        while True:
            if key().lower() == "q":
                return 0
            if time.monotonic() >= next_at:
                try:
                    last, down_since = frame(c.get("/v1/overview")), None
                    live.update(last, refresh=True)
                except ClientError as e:
                    if e.exit_code != EX_UNAVAILABLE:   # refused or broken, not away: say so and quit
                        raise
                    down_since = down_since or time.time()
                    live.update(unavailable(last, e, down_since), refresh=True)
                next_at = time.monotonic() + interval
            time.sleep(0.05)
