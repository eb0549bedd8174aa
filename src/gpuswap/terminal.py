"""What every command that prints to a terminal shares: the one rich console, verbatim text, and a
job's state in words. Below the CLI (cli/render.py builds its tables on it) so that the commands
the CLI runs, `gpuswap demo` and `gpuswap selftest`, use it without importing the CLI back.

Text a user or the machine chose goes to rich as a `Text` (`plain`), never as markup (cli/render.py
says why), and with its control characters shown, not sent (`printable`): a job's name, command or
output-derived reason is another user's words on an admin's terminal, and an escape sequence in
them would set its title, clear it, or worse.
"""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

from gpuswap.jobs import ENDED, format_size
from gpuswap.printable import printable

class PipeConsole(Console):
    """rich's Console, for output a reader may stop reading (every console of ours)."""

    def on_broken_pipe(self) -> None:
        """The reader went away (`gpuswap ls | head -1`): as for a plain print (cli/main.py), not a
        failure. rich's own answer is exit 1 with no message, which fails a script's pipefail."""
        self.quiet = True
        raise BrokenPipeError


console = PipeConsole(highlight=False)
if not console.is_terminal:          # piped or captured: do not wrap records at 80 columns
    console = PipeConsole(highlight=False, width=200)


def plain(value: Any, style: str = "") -> Text:
    """A value shown verbatim: rich markup in it is text, not style; control characters are escaped."""
    return Text("" if value is None else printable(str(value)), style=style)


def residue_text(j: dict[str, Any]) -> str:
    """'512.0 MiB stays on GPU 0': what a job parked in RAM still holds on its GPUs ('' if nothing)."""
    return "; ".join(f"{format_size(r['bytes'])} stays on GPU {r['gpu']}" for r in j.get("residue") or [])


def state_text(j: dict[str, Any]) -> str:
    if j["state"] == "PAUSED":
        if j.get("stopped") and not j.get("parked"):
            return "PAUSED (SIGSTOP, GPU memory still held)"
        where = {"ram": "in RAM", "disk": "on disk"}.get(j.get("parked") or "", "?")
        how = ", frozen by the driver" if j.get("mechanism") == "transparent" else ""
        stays = f"; {residue_text(j)}" if j.get("residue") else ""
        ranks = f"{len(j['ranks'])} ranks, " if len(j.get("ranks") or []) > 1 else ""
        return f"PAUSED (parked {where}, {ranks}{format_size(j.get('parked_bytes') or 0)}{how}{stays})"
    if j["state"] in ENDED and j.get("exit_code") is not None:
        return f"{j['state']} ({j['exit_code']})"
    return j["state"]
