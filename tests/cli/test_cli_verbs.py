"""Every verb README documents is registered, and a verb whose module cannot be imported fails
loudly instead of silently vanishing from the CLI (cli/main.py used to swallow the `sim` ImportError)."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from gpuswap.cli.main import VERB_MODULES, build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def documented_verbs() -> set[str]:
    """The first word of each `code` span in the first column of README's CLI table."""
    text = README.read_text()
    table = text.split("### CLI", 1)[1].split("\n\n", 2)[1]
    verbs = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split(" | ")[0]
        verbs |= {span.split()[0] for span in re.findall(r"`([^`]+)`", first_cell)}
    return verbs


def registered_verbs() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "verb")
    return set(sub.choices)


def test_every_documented_verb_is_registered():
    documented = documented_verbs()
    assert {"server", "submit", "ls", "sim", "demo", "top", "token", "slurm-wrap"} <= documented, documented
    missing = documented - registered_verbs()
    assert not missing, f"README documents verbs the CLI lacks: {sorted(missing)}"


def test_a_broken_verb_module_fails_loudly(monkeypatch):
    import gpuswap.sim

    monkeypatch.setitem(sys.modules, "gpuswap.sim.cli", None)   # importing it now raises ImportError
    monkeypatch.delattr(gpuswap.sim, "cli", raising=False)      # (`from gpuswap.sim import cli` looks here first)
    with pytest.raises(ImportError):
        build_parser()


def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return dict(next(a for a in parser._actions if a.dest == "verb").choices)


def signature(parser: argparse.ArgumentParser) -> list[object]:
    """A parser's help and every argument's name, default and choices, its sub-verbs' included."""
    out: list[object] = [parser.format_help()]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += [(name, signature(child)) for name, child in a.choices.items()]
        elif a.dest != "help":
            out.append((a.dest, a.option_strings, a.default, a.choices))
    return out


def test_each_verb_alone_parses_as_in_the_whole_command_line():
    """`main` builds only the parsers of the module that defines the verb it runs (build_parser's
    `verb`): every verb must be there, with the same options, defaults and help as in the whole."""
    whole = verb_parsers(build_parser())
    assert set(whole) == set().union(*(verbs for verbs, _ in VERB_MODULES)), "VERB_MODULES is out of date"
    for verb, parser in whole.items():
        alone = verb_parsers(build_parser(verb))
        assert verb in alone and len(alone) < len(whole), (verb, sorted(alone))
        assert signature(alone[verb]) == signature(parser), verb
