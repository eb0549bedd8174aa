"""What `gpuswap --help` says beyond each argument: the defaults, the exit codes, the environment
variables gpuswap reads, and `--version`.

The variables are written out here rather than imported from the modules that read them: the help
is built on every CLI call, and the job-side modules are not cheap to import. tests/cli/test_help.py
checks that every `ENV_*` name in the source is listed here.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any, Optional, Sequence

from gpuswap.exitcodes import DESCRIBED


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, with each option's default appended where its help does not already say it;
    descriptions and epilogs are kept as written (they hold tables)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        default = action.default
        if ("default" in text.lower() or not action.option_strings or action.nargs == 0
                or default is None or default is argparse.SUPPRESS or isinstance(default, bool)):
            return text
        return f"{text} (default: %(default)s)"


def _table(title: str, rows: Sequence[tuple[str, str]], width: int = 0, columns: int = 100) -> str:
    """A titled two-column table, its second column wrapped under itself."""
    width = width or max(len(k) for k, _ in rows) + 2
    out = [f"{title}:"]
    for key, text in rows:
        lines = textwrap.wrap(text, columns - 2 - width) or [""]
        if len(key) >= width:          # a long key: its text starts on the next line
            out.append(f"  {key}")
            out += [" " * (2 + width) + line for line in lines]
            continue
        out.append(f"  {key:<{width}}{lines[0]}")
        out += [" " * (2 + width) + line for line in lines[1:]]
    return "\n".join(out)


EXIT_CODES = _table("exit codes", DESCRIBED)

ENVIRONMENT = _table("environment", (
    ("GPUSWAP_HOME", "the daemon's state directory (socket, database, logs, checkpoints); default "
                     "/var/lib/gpuswap for root or when a machine-wide daemon serves there, else ~/.gpuswap"),
    ("GPUSWAP_CONFIG", "`server`: its config file (see `gpuswap server --help`)"),
    ("GPUSWAP_URL", "reach a daemon over TCP (`gpuswap server --listen`) instead of its Unix socket"),
    ("GPUSWAP_TOKEN", "the bearer token for GPUSWAP_URL (`gpuswap token create`)"),
    ("GPUSWAP_AGENT_HOME", "a Ray pool node's agent (in that node's `ray start` environment): its "
                           "state directory; default /var/lib/gpuswap/node (docs/ray.md)"),
    ("GPUSWAP_AGENT_SIMULATE_GPUS", "a Ray pool node's agent: simulated GPUs there, as --simulate-gpus"),
    ("GPUSWAP_NODE_NAME", "a Ray pool node's agent: the node's name in the pool; default its host name"),
    ("GPUSWAP_AGENT_SHARED_CKPT", "a Ray pool node's agent: a directory on storage every node mounts at "
                                  "that path; disk checkpoints there resume on any such node"),
))

# Set for each job by its supervisor, and read by the runtime in the job (`gpuswap.attach`).
JOB_ENVIRONMENT = "\n\n".join((
    _table("set for the job (besides your own environment)", (
        ("CUDA_VISIBLE_DEVICES", "the GPUs it was given"),
        ("GPUSWAP_JOB_ID", "its job id"),
        ("GPUSWAP_CONTROL", "its supervisor's socket, which `gpuswap.attach` connects to"),
        ("GPUSWAP_CKPT_DIR", "where its disk checkpoints live"),
        ("GPUSWAP_SIMULATED_GPU", '"1" on simulated GPUs: there is no GPU, CPU tensors stand in'),
    ), 24),
    _table("read by the runtime in the job", (
        ("GPUSWAP_RESTART_ON_BAD_CHECKPOINT", '"1": when no checkpoint is usable, start from step 0 '
                                              "instead of failing"),
        ("GPUSWAP_ADOPT_CHECKPOINTS", "a job id: resume from the checkpoints that job left in "
                                      "GPUSWAP_CKPT_DIR (otherwise another job's are refused)"),
        ("GPUSWAP_PINNED_KEEP_S", "seconds an idle pinned host buffer is kept for the next park "
                                  "(0 to 3600; default 30)"),
        ("GPUSWAP_PREFAULT", '"0": do not prepare the host buffers of a park when the pause is '
                             "asked (it uses CPU while the step finishes; default on)"),
    ), 36),
))

SLURM_ENVIRONMENT = _table("environment", (
    ("GPUSWAP_SLURM_SIGNALS", "signals to act on when --signals is not given (default USR2,TERM; "
                              "'none' for none)"),
    ("GPUSWAP_SLURM", '"0": the runtime in the job stays off under Slurm'),
    ("GPUSWAP_SLURM_REQUEUE", "after a checkpoint: scontrol (requeue the job, the default) or exit "
                              "(only exit 75, Slurm requeues)"),
    ("GPUSWAP_SLURM_PAUSE_TIMEOUT_S", "a phase of the ranks' agreement that takes longer ends it "
                                     "(1 to 86400; default 300)"),
))

# Internal (the simulated driver's directory) or read only by tests, and documented where they
# are read: not part of the interface.
INTERNAL = ("GPUSWAP_USAGE_INTERVAL_S", "GPUSWAP_SIM_CONTEXT_BYTES", "GPUSWAP_SELFTEST_WRONG_REFERENCE",
             "GPUSWAP_SIM_CUDA_DIR", "GPUSWAP_SIM_DEVICES")


def version() -> str:
    """'gpuswap 0.1.0 (from /path/to/gpuswap, Python 3.11.7)': the installed distribution's version
    (an editable install has one too) and where the code runs from, which is what an admin asks
    of a service's binary."""
    import importlib.metadata
    from pathlib import Path

    import gpuswap

    try:
        number = importlib.metadata.version("gpuswap")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown (not installed)"
    where = Path(gpuswap.__file__).resolve().parent
    return f"gpuswap {number} (from {where}, Python {sys.version.split()[0]})"


class VersionAction(argparse.Action):
    """`--version`, looked up only when asked for (argparse's own takes the string up front)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version())
        parser.exit()
