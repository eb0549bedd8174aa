"""`gpuswap completion bash|zsh`: a shell completion script, generated from the parser itself by
shtab, so it knows every verb and option there is and needs no Python at TAB time.

    gpuswap completion bash | sudo tee /etc/bash_completion.d/gpuswap   # or: eval "$(gpuswap completion bash)"
    gpuswap completion zsh > "${fpath[1]}/_gpuswap"                     # then start a new shell
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from gpuswap.api.client import ClientError
from gpuswap.exitcodes import EX_FAILURE

SHELLS = ("bash", "zsh")
FILES = ("--config", "--trace")                   # options that take a file
DIRECTORIES = ("--dcgm-job-mapping-dir", "--out")      # options that take a directory


def register(sub: Any, build_parser: Callable[[], argparse.ArgumentParser]) -> None:
    s = sub.add_parser("completion", help="print a shell completion script: gpuswap completion bash|zsh",
                       description=__doc__)
    s.add_argument("shell", choices=SHELLS, help="the shell the script is for")
    s.set_defaults(func=lambda a: run(a, build_parser))


def _mark_paths(parser: argparse.ArgumentParser, shtab: Any) -> None:
    """Let the shell complete file and directory names where an option takes one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _mark_paths(child, shtab)
        elif set(action.option_strings) & set(FILES):
            action.complete = shtab.FILE        # type: ignore[attr-defined]
        elif set(action.option_strings) & set(DIRECTORIES):
            action.complete = shtab.DIRECTORY   # type: ignore[attr-defined]


def run(a: argparse.Namespace, build_parser: Callable[[], argparse.ArgumentParser]) -> int:
    try:
        import shtab
    except ImportError:
        raise ClientError("shell completion needs the shtab package: pip install shtab", EX_FAILURE) from None
    parser = build_parser()
    _mark_paths(parser, shtab)
    print(shtab.complete(parser, shell=a.shell))
    return 0
