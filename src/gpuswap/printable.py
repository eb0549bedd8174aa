"""Other people's words on a terminal: control characters shown as escapes, never sent.

A job's name, command, cwd and the reasons and errors its runtime reports are chosen by its user
(or its program); `gpuswap ls --all-users` shows them on an admin's terminal, where an escape
sequence would set the window title, clear the screen, write the clipboard (OSC 52) or recolour
what follows. Kept apart from terminal.py (rich) so the CLI's plain prints use it without the import.
"""
from __future__ import annotations

import re

# C0 and C1 control characters, DEL, and the Unicode bidirectional overrides (which reorder what
# follows them on screen): none is ever shown as itself.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with each control character written as its escape (ESC as \\x1b, a newline as \\n)."""
    if not _CONTROL.search(text):
        return text
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
