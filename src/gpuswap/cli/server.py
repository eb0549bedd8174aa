"""`gpuswap server`: its flags are made from the settings object (node/settings.py), so each is
declared once, with its default, unit and help; flags override the config file, which overrides
the defaults."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from gpuswap.exitcodes import EX_FAILURE, EX_UNAVAILABLE, EX_USAGE
from gpuswap.node import settings
from gpuswap.protocol import env as envvars

CONFIG_HELP = f"""\
config file:
  Every option above can be set in a TOML file instead: its key is the option's name without the
  dashes (`min-runtime = 30`, `listen = "127.0.0.1:8080"`, `calibrate = false` for --no-calibrate).
  Options given on the command line override the file; the file overrides the defaults.
  The file is --config PATH, else ${envvars.CONFIG}, else {settings.SYSTEM_CONFIG} for the
  machine-wide daemon (state directory /var/lib/gpuswap) or $GPUSWAP_HOME/{settings.CONFIG_NAME} for any
  other; a file named by --config or ${envvars.CONFIG} must exist, the default is read only if it
  does. It must be a regular file (not a FIFO or a device), writable by its owner only, root or
  the daemon's user. An unknown key or a bad value is a usage error (exit 64) that names the file
  and the key.
  `gpuswap server --print-config` prints the settings in force as such a file.

stopping:
  SIGTERM or SIGINT stops the daemon and leaves every job running under its supervisor; the next
  daemon for the same state directory takes them up again (docs/service.md: KillMode=process)."""


def register(sub: Any) -> None:
    s = sub.add_parser("server", help="run the daemon for this machine (or this GPUSWAP_HOME)",
                       description="The gpuswap daemon: it schedules the jobs of one state directory "
                                   "(GPUSWAP_HOME) on this machine's GPUs.", epilog=CONFIG_HELP)
    for name, spec, default in settings.specs():
        text = f"{spec.help} (default: {settings.default_text(spec, default)})"
        if isinstance(default, bool):      # a switch: given, it turns the default around
            s.add_argument(spec.option, dest=name, action="store_const", const=not default,
                           default=argparse.SUPPRESS, help=spec.flag_help or text)
        else:                              # text, read with the file's values by settings.load
            s.add_argument(spec.option, dest=name, metavar=spec.unit, default=argparse.SUPPRESS, help=text)
    s.add_argument("--config", metavar="PATH",
                   help=f"read settings from this TOML file (default: ${envvars.CONFIG}, else "
                        f"{settings.SYSTEM_CONFIG} or $GPUSWAP_HOME/{settings.CONFIG_NAME}, if it exists)")
    s.add_argument("--print-config", action="store_true",
                   help="print the settings in force (flags, config file, defaults) as a config file, and exit")
    s.set_defaults(func=cmd_server)


def resolve(a: argparse.Namespace) -> tuple[Any, settings.ServerSettings, str]:
    """(home, settings, where they came from); SettingsError for anything unusable."""
    from gpuswap.api.client import SYSTEM_HOME, default_home

    home = default_home()
    path, must_exist = settings.config_file(a.config, os.environ, home, SYSTEM_HOME)
    values = settings.read_file(path, must_exist)
    flags = {name: getattr(a, name) for name, _, _ in settings.specs() if hasattr(a, name)}
    sources = f"flags > {path} > defaults" if values else f"flags > defaults; no config file at {path}"
    return home, settings.load(flags, values, path), sources


def cmd_server(a: argparse.Namespace) -> int:
    from gpuswap.api.serving import frontend
    from gpuswap.node.daemon import DaemonError, DaemonUnavailable, serve

    try:
        home, opts, sources = resolve(a)
    except settings.SettingsError as e:
        print(f"gpuswap server: {e}", file=sys.stderr)
        return EX_USAGE
    if a.print_config:
        print(settings.to_toml(opts, sources))
        return 0
    if opts.ray and opts.simulate_gpus:
        print("gpuswap server: --simulate-gpus names this machine's GPUs; with --ray each node's agent has its "
              "own (GPUSWAP_AGENT_SIMULATE_GPUS in that node's environment, docs/ray.md)", file=sys.stderr)
        return EX_USAGE
    if opts.dcgm_job_mapping_dir is not None and not opts.ray:    # with --ray none is kept (daemon.py)
        try:       # now, not in the writer's first pass: a daemon that cannot write there does not start
            settings.make_directory(opts.dcgm_job_mapping_dir, "--dcgm-job-mapping-dir")
        except settings.SettingsError as e:
            print(f"gpuswap server: {e}", file=sys.stderr)
            return EX_USAGE
    try:
        serve(home, opts, frontend(opts.admin_group))
    except DaemonUnavailable as e:
        print(f"gpuswap server: {e}", file=sys.stderr)
        return EX_UNAVAILABLE
    except DaemonError as e:
        print(f"gpuswap server: {e}", file=sys.stderr)
        return EX_FAILURE
    return 0
