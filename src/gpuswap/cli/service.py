"""`gpuswap service install [--print]`: the systemd unit shipped in the package
(gpuswap/deploy/gpuswap.service; the reasons for each directive are in it, and docs/service.md),
with ExecStart pointing at the gpuswap that runs this command, written where systemd reads it.

It writes one file and starts nothing: enabling a root daemon is the admin's own step, and the
command says which."""
from __future__ import annotations

import argparse
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from gpuswap.api.client import ClientError
from gpuswap.exitcodes import EX_FAILURE, EX_USAGE

UNIT_NAME = "gpuswap.service"
UNIT_DIR = Path("/etc/systemd/system")


def register(sub: Any) -> None:
    s = sub.add_parser("service", help="install the daemon as a systemd service (docs/service.md)",
                       description=__doc__)
    ssub = s.add_subparsers(dest="service_verb", required=True, parser_class=type(s))
    i = ssub.add_parser("install", help="write the systemd unit for this installation of gpuswap",
                        description=__doc__)
    i.add_argument("--print", dest="print_only", action="store_true",
                   help="print the unit on stdout instead of writing it")
    i.add_argument("--path", type=Path, default=UNIT_DIR / UNIT_NAME, metavar="FILE",
                   help="where to write the unit")
    i.add_argument("--force", action="store_true",
                   help="replace a unit file that exists and differs (local changes belong in "
                        "`systemctl edit gpuswap` instead)")
    i.set_defaults(func=cmd_install)
    ssub.metavar = "{" + ",".join(ssub.choices) + "}"


def template() -> str:
    return resources.files("gpuswap").joinpath("deploy", UNIT_NAME).read_text()


def this_gpuswap() -> list[str]:
    """The command that runs this installation: its `gpuswap` script when that is what runs now,
    else this interpreter with `-m` (an editable or unusual install, or `python -m`)."""
    script = Path(sys.argv[0]).absolute() if sys.argv and sys.argv[0] else None
    if script is not None and script.name == "gpuswap" and script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(Path(sys.executable).absolute()), "-m", "gpuswap.cli.main"]


def exec_quote(arg: str) -> str:
    """One ExecStart word: systemd expands % specifiers and $ variables, and splits on spaces."""
    if any(c in arg for c in "\n\r\0"):
        raise ClientError(f"cannot write {arg!r} into a unit file (a newline or NUL in the path)", EX_USAGE)
    word = arg.replace("%", "%%").replace("$", "$$")
    if any(c.isspace() or c in "\"'\\;" for c in word):
        word = '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def unit(command: list[str]) -> str:
    """The shipped unit with its ExecStart line running `command server`."""
    lines = template().splitlines(keepends=True)
    at = [n for n, line in enumerate(lines) if line.startswith("ExecStart=")]
    assert len(at) == 1, "the shipped unit has one ExecStart line"
    lines[at[0]] = "ExecStart=" + " ".join(exec_quote(a) for a in [*command, "server"]) + "\n"
    return "".join(lines)


def cmd_install(a: argparse.Namespace) -> int:
    from gpuswap.fsutil import atomic_write_bytes
    from gpuswap.node.settings import SYSTEM_CONFIG

    text = unit(this_gpuswap())
    if a.print_only:
        sys.stdout.write(text)
        return 0
    path: Path = a.path
    try:
        old = path.read_text() if path.exists() else None
        if old == text:
            print(f"{path} is already this unit; nothing to do")
            return 0
        if old is not None and not a.force:
            raise ClientError(f"{path} exists and differs from this installation's unit; --force replaces "
                              "it (local changes belong in `systemctl edit gpuswap`)", EX_FAILURE)
        atomic_write_bytes(path, text.encode(), 0o644)
    except OSError as e:
        raise ClientError(f"cannot write {path}: {e.strerror or e} (as root; or --print to see it)", EX_FAILURE) from None
    print(f"wrote {path}\n"
          f"next:     sudo systemctl daemon-reload && sudo systemctl enable --now {path.stem}\n"
          f"settings: {SYSTEM_CONFIG} (`gpuswap server --print-config` prints them; `gpuswap server "
          "--help` says what each does)\n"
          f"status:   systemctl status {path.stem}; journalctl -u {path.stem}")
    return 0
