"""`gpuswap --help` documents every argument, the exit codes and the environment; `--version`
says which gpuswap runs; `gpuswap completion` knows every verb."""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuswap import exitcodes
from gpuswap.cli import helptext
from gpuswap.cli.main import build_parser

SRC = Path(__file__).resolve().parents[2] / "src" / "gpuswap"


def gpuswap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, COLUMNS="100"))


def parsers(parser: argparse.ArgumentParser, path: str = "gpuswap"):
    """(path, parser) for the top parser and every verb below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, f"{path} {name}")


def test_every_argument_of_every_verb_has_help():
    missing = []
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if (a.help or "").strip()}
                missing += [f"{path} {verb}" for verb in action.choices if verb not in helped]
            elif not (action.help or "").strip():
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"arguments without help: {missing}"
    assert len(list(parsers(build_parser()))) > 20


def test_help_shows_each_options_default():
    formatter = helptext.HelpFormatter("gpuswap")
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            default = action.default
            if (action.option_strings and action.nargs != 0 and default not in (None, argparse.SUPPRESS)
                    and not isinstance(default, bool)):
                text = formatter._get_help_string(action) or ""
                assert "default" in text.lower(), (path, action.option_strings, text)
    server = gpuswap("server", "--help").stdout
    for shown in ("(default: 60)", "(default: 0.2)", "(default: 30d)", "(default: gpuswap-admin)",
                  "(default: half of the machine's RAM)", "(default: wait)"):
        assert shown in server, shown


def test_top_help_lists_every_exit_code_and_the_environment():
    r = gpuswap("--help")
    assert r.returncode == 0, r.stderr
    codes = {v for k, v in vars(exitcodes).items() if k.startswith("EX_")}
    for code in codes:
        assert re.search(rf"^  (\d+, )?{code}\b", r.stdout, re.M), (code, r.stdout)
    for var in ("GPUSWAP_HOME", "GPUSWAP_CONFIG", "GPUSWAP_URL", "GPUSWAP_TOKEN"):
        assert var in r.stdout
    assert "GPUSWAP_RESTART_ON_BAD_CHECKPOINT" in gpuswap("submit", "--help").stdout
    assert "GPUSWAP_SLURM_SIGNALS" in gpuswap("slurm-wrap", "--help").stdout
    assert "config file" in gpuswap("server", "--help").stdout


def test_every_environment_variable_gpuswap_reads_is_documented():
    """Each GPUSWAP_* name in the source is in one of the help texts (or marked internal)."""
    names = set()
    for path in SRC.rglob("*.py"):
        names |= set(re.findall(r"\"(GPUSWAP_[A-Z0-9_]+)\"", path.read_text()))
    documented = helptext.ENVIRONMENT + helptext.JOB_ENVIRONMENT + helptext.SLURM_ENVIRONMENT
    missing = {n for n in names if n not in documented and n not in helptext.INTERNAL}
    assert names and not missing, sorted(missing)


def test_version_is_the_installed_distributions():
    r = gpuswap("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"gpuswap {importlib.metadata.version('gpuswap')} (from ")
    assert r.stdout.count("\n") == 1


def test_the_package_and_its_metadata_agree_on_the_version():
    """pyproject.toml's version (the installed metadata) and gpuswap.__version__ (the API's
    /v1/health, the metrics) are declared apart: they must not drift."""
    import gpuswap

    assert importlib.metadata.version("gpuswap") == gpuswap.__version__


def test_help_and_usage_errors_exit_as_documented():
    assert gpuswap("ls", "--help").returncode == 0
    r = gpuswap("server", "--bogus")
    assert r.returncode == exitcodes.EX_USAGE and "unrecognized arguments: --bogus" in r.stderr


# -- shell completion --------------------------------------------------------------------------
def verbs() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_mentions_every_verb(shell):
    pytest.importorskip("shtab")
    r = gpuswap("completion", shell)
    assert r.returncode == 0, r.stderr
    for verb in verbs():
        assert re.search(rf"(?<![\w-]){re.escape(verb)}(?![\w-])", r.stdout), (shell, verb)
    assert "--min-runtime" in r.stdout and "--print-config" in r.stdout


def test_bash_completes_verbs_and_options(tmp_path):
    """The bash script, sourced in a real bash, completes `gpuswap se<TAB>` and an option."""
    pytest.importorskip("shtab")
    script = tmp_path / "gpuswap.bash"
    script.write_text(gpuswap("completion", "bash").stdout)
    probe = f"""source {script}
complete_words() {{ COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _shtab_gpuswap; echo "${{COMPREPLY[*]}}"; }}
complete_words gpuswap se
complete_words gpuswap server --min-r
complete_words gpuswap completion ''
"""
    r = subprocess.run(["bash", "--norc", "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["server selftest service", "--min-runtime", "bash zsh"], r.stdout


def test_completion_of_an_unknown_shell_is_a_usage_error():
    r = gpuswap("completion", "fish")
    assert r.returncode == exitcodes.EX_USAGE and "invalid choice" in r.stderr
