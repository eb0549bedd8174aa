"""The daemon's settings: one typed object whose fields carry their default, unit and help, filled
from three sources in order of precedence: command-line flags > config file (TOML) > defaults.

Why one object: the defaults used to be declared three times (the flags, the daemon's options, the
controller's config) and checked twice (argparse types, then again at start). Here each setting is
declared once, and every value, whatever its source, passes once through its field's reader: a
flag's text and a TOML value meet the same check and the same one-line error (exit 64).

The config file is `--config PATH`, else `$GPUSWAP_CONFIG`, else /etc/gpuswap/gpuswap.toml for the
machine-wide daemon (home /var/lib/gpuswap) and `HOME/gpuswap.toml` for a daemon of any other
state directory; a file named by the first two must exist, the default one is read only if it
does. Its keys are the flags' names without the dashes (`calibrate = false` for `--no-calibrate`).
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import errno
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Optional

from gpuswap.jobs import parse_size
from gpuswap.policy import DEFAULT_POLICY, LIVE_POLICIES, POLICIES
from gpuswap.policy.model import PolicyConfig
from gpuswap.protocol import env as envvars

SYSTEM_CONFIG = Path("/etc/gpuswap/gpuswap.toml")
CONFIG_NAME = "gpuswap.toml"          # beside the state of any other daemon: HOME/gpuswap.toml
_POLICY = PolicyConfig()              # the policy's own defaults: min-runtime, protect-*, max-switch-fraction


class SettingsError(Exception):
    """A setting the daemon cannot run with, or a config file it cannot use: one line, exit 64."""


# -- readers: (raw value, its name for errors) -> value, or ValueError saying why -------------------
def _kind(raw: Any) -> str:
    """A TOML value's type, as the TOML spec names it, for errors about a file."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
             (list, "an array"), (dict, "a table"), (datetime.date, "a date"), (datetime.time, "a time"))
    return next((name for t, name in kinds if isinstance(raw, t)), type(raw).__name__)


def _string(raw: Any, name: str) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"{name} must be a string, not {_kind(raw)}")
    return raw


def _number(raw: Any, name: str) -> float:
    """A finite number >= 0: nan, inf and negatives are errors, not values that silently mean
    'forever' or 'never'. Text (a flag) or a TOML integer or float; never a boolean."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{name} must be a number, not {_kind(raw)}")
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        raise ValueError(f"{name} {raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} {raw!r} must be a finite number >= 0")
    return value


def _gpu_hours(raw: Any, name: str) -> float:
    """A class budget in GPU-hours >= 0, or no budget: "none", "off" or inf (TOML's `inf`)."""
    if isinstance(raw, str) and raw.strip().lower() in ("none", "off", "inf"):
        return math.inf
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError(f"{name} must be a number of GPU-hours or \"none\", not {_kind(raw)}")
    try:
        value = float(raw)
    except (ValueError, OverflowError):
        raise ValueError(f"{name} {raw!r} is not a number of GPU-hours (or \"none\")") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} {raw!r} must be a number of GPU-hours >= 0, or \"none\"")
    return value


def _share(raw: Any, name: str) -> float:
    """A share of the GPUs: 0 <= x < 1."""
    value = _number(raw, name)
    if value >= 1:
        raise ValueError(f"{name} {raw!r} must be a share of the GPUs below 1 (e.g. 0.25)")
    return value


def _positive(raw: Any, name: str) -> float:
    value = _number(raw, name)
    if value <= 0:
        raise ValueError(f"{name} {raw!r} must be > 0")
    return value


def _boolean(raw: Any, name: str) -> bool:
    if not isinstance(raw, bool):
        raise ValueError(f"{name} must be true or false, not {_kind(raw)}")
    return raw


def _choice(*choices: str) -> Callable[[Any, str], str]:
    def read(raw: Any, name: str) -> str:
        if _string(raw, name) not in choices:
            raise ValueError(f"{name} {raw!r} must be one of: {', '.join(choices)}")
        return raw
    return read


def _policy(raw: Any, name: str) -> str:
    """A policy the daemon can run: an unknown one would fail every controller tick and leave every
    job PENDING for good."""
    if _string(raw, name) not in LIVE_POLICIES:
        why = ("needs each job's true remaining time, so it runs only in the simulator (gpuswap sim)"
               if raw in POLICIES else "is not a policy")
        raise ValueError(f"{name} {raw!r} {why}; choose one of: {', '.join(LIVE_POLICIES)}")
    return raw


def _gpu_spec(raw: Any, name: str) -> str:
    from gpuswap.node.gpus import SimulatedGpus

    spec = str(raw) if isinstance(raw, int) and not isinstance(raw, bool) else _string(raw, name)
    SimulatedGpus.parse(spec, name)          # refused here, before the daemon touches its home
    return spec


def _size(raw: Any, name: str) -> int:
    """Bytes: a size with its unit ("64GiB"), or a whole number of bytes."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 0:
            raise ValueError(f"{name} {raw} must be >= 0 bytes")
        return raw
    try:
        return parse_size(_string(raw, name))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _duration(raw: Any, name: str) -> Optional[float]:
    """Seconds: "30d", "12h", "90m", "45s", "2w", a number of seconds, or "never" (None)."""
    from gpuswap.node.retention import parse_duration

    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return _number(raw, name)
    try:
        return parse_duration(_string(raw, name))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _listen(raw: Any, name: str) -> str:
    from gpuswap.node.listener import ListenError, parse_listen

    try:   # an unreadable address is a usage error; one that cannot be bound (taken) is not
        parse_listen(_string(raw, name), name)
    except ListenError as e:
        raise ValueError(str(e)) from None
    return raw


def _ray_address(raw: Any, name: str) -> str:
    """"auto", or a Ray cluster's address: HOST:PORT, or a ray:// URL."""
    text = _string(raw, name).strip()
    if text == "auto" or text.startswith("ray://") or re.fullmatch(r"[^\s:/]+:\d{1,5}", text):
        return text
    raise ValueError(f"{name} {raw!r}: write auto, or the Ray cluster's address as HOST:PORT")


def _directory(raw: Any, name: str) -> Path:
    """A directory, or a path where one can be made (by `make_directory` at start): anything else
    there (a file) would fail every write the daemon makes into it, for as long as it runs."""
    if not _string(raw, name).strip():
        raise ValueError(f"{name} must name a directory, not an empty string")
    path = _expand(raw, name)
    if os.path.exists(path) and not os.path.isdir(path):   # os.path: False, not OSError, for a name too long
        raise ValueError(f"{name} {raw!r} is not a directory")
    return path


def _expand(raw: str, name: str) -> Path:
    """The path, with ~ and ~USER expanded: ValueError for a user with no home directory."""
    try:
        return Path(raw).expanduser()
    except RuntimeError:
        raise ValueError(f"{name} {raw!r}: cannot expand {raw.split('/')[0]!r}: no such user's home directory") from None


def make_directory(path: Path, name: str) -> None:
    """Make a directory setting's directory (and its parents) where the daemon will write, before
    it starts: SettingsError (exit 64) if that cannot be done."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:      # ValueError: a NUL in a TOML string
        raise SettingsError(f"{name} {str(path)!r}: cannot make the directory: "
                            f"{getattr(e, 'strerror', None) or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError(f"{name} {str(path)!r}: the directory is not writable by this user")


# -- how values read back, as TOML literals (`gpuswap server --print-config`) ----------------------
def _toml(value: Any) -> Optional[str]:
    """A TOML literal; None for a setting that is not set (TOML has no null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A TOML basic string takes JSON's escapes; DEL must be escaped too, and non-ASCII stays as is
    # (TOML's \u escapes cannot spell surrogate pairs).
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_duration(value: Optional[float]) -> str:
    if value is None:
        return '"never"'
    for unit, seconds in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if value >= seconds and value % seconds == 0:
            return f'"{value / seconds:g}{unit}"'
    return _toml(value)


def _toml_size(value: Optional[int]) -> Optional[str]:
    if value is None:
        return None
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale and value % scale == 0:
            return f'"{value // scale}{unit}"'
    return _toml(value)


# -- the settings ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """What the flag, the config file and the help say about one setting."""
    key: str                              # the config file's key; the flag is --KEY, unless `flag`
    help: str
    read: Callable[[Any, str], Any]       # the one check every value of this setting passes
    unit: str = ""                        # the flag's metavar ("SECONDS"); none for a switch
    default_text: str = ""                # the default in words, where the value alone says too little
    flag: str = ""                        # "--no-calibrate": a switch that turns a true default off
    flag_help: str = ""                   # what that switch does, where `help` says what the key does
    show: Callable[[Any], Optional[str]] = _toml   # value -> TOML literal; None: not set

    @property
    def option(self) -> str:
        return self.flag or f"--{self.key}"


def _setting(default: Any, key: str, help: str, read: Callable[[Any, str], Any], **spec: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(key, help, read, **spec)})


@dataclass(frozen=True)
class ServerSettings:
    """Everything `gpuswap server` can be told; the state directory (GPUSWAP_HOME) is not a setting:
    it names the daemon, and its clients find it by the same variable."""
    simulate_gpus: Optional[str] = _setting(
        None, "simulate-gpus", 'simulated GPUs for machines without one, e.g. "2x80GiB" (COUNTxSIZE; '
        "a bare COUNT is of 80 GiB); no real GPU is used, and every view says SIMULATED", _gpu_spec,
        unit="SPEC", default_text="the machine's real GPUs")
    ray: Optional[str] = _setting(
        None, "ray", 'schedule the GPUs of every node of a Ray cluster as one pool: "auto" for the '
        "cluster this machine belongs to, or its address (HOST:PORT); needs gpuswap[ray] (docs/ray.md)",
        _ray_address, unit="ADDRESS", default_text="this machine alone")
    node_lost_s: float = _setting(
        600.0, "node-lost-after", "with --ray: a node Ray reports gone (or not seen since the head "
        "started) this long is lost for good; its jobs end FAILED (docs/ray.md)", _number, unit="SECONDS")
    policy: str = _setting(
        DEFAULT_POLICY, "policy", f"scheduling policy: {', '.join(LIVE_POLICIES)} (docs/policies.md)", _policy,
        unit="NAME")
    min_runtime_s: float = _setting(
        _POLICY.min_runtime_s, "min-runtime",
        "no job is preempted within this long after a start or resume: the floor of its protection, "
        "which otherwise follows what a switch of it costs (--protect-multiple, --protect-cap)",
        _number, unit="SECONDS")
    protect_multiple: float = _setting(
        _POLICY.protect_multiple, "protect-multiple",
        "after a start or resume a job is protected for this many times what parking and resuming "
        "it costs, between --min-runtime and --protect-cap (0: --min-runtime for every job)",
        _number, unit="FACTOR")
    protect_cap_s: float = _setting(
        _POLICY.protect_cap_s, "protect-cap",
        "the longest protection after a start or resume, however costly a switch of the job (a "
        "higher --min-runtime wins)", _number, unit="SECONDS")
    max_switch_fraction: float = _setting(
        _POLICY.max_switch_fraction, "max-switch-fraction",
        "anti-thrashing: never preempt a job if pausing and resuming it would make switching more than "
        "this fraction of its life", _number, unit="FRACTION")
    reserve_after_s: Optional[float] = _setting(
        _POLICY.reserve_after_s, "reserve-after",
        "a job that has waited this long gets a reservation on the node that can free its GPUs soonest: "
        'no job behind it may start or preempt into them (gpuswap policy; e.g. 10m, 600, or "never")',
        _duration, unit="DURATION", default_text="10m", show=_toml_duration)
    # Classes with limits (issue 15 item 5; policy/classes.py, docs/policies.md), gpuswap policy only.
    class_budget_gpu_h: float = _setting(
        _POLICY.class_budget_gpu_h, "class-budget",
        "a user's decayed GPU-hours at urgent (or high) beyond which their jobs of that class count one "
        'class down; "none" for no budget', _gpu_hours, unit="GPU_HOURS")
    class_half_life_s: float = _setting(
        _POLICY.class_half_life_s, "class-half-life", "half-life of the GPU-time the class budget counts",
        _positive, unit="SECONDS")
    class_floor_share: float = _setting(
        _POLICY.class_floor_share, "class-floor",
        "share of the GPUs each class below the highest keeps against the classes above it (a user "
        "within budget keeps the head start); 0 for none", _share, unit="SHARE")
    pause_timeout_s: float = _setting(
        60.0, "pause-timeout", "how long to wait for a safepoint before falling back", _number, unit="SECONDS")
    attach_grace_s: float = _setting(
        30.0, "attach-grace", "how long an auto-mode job may run before its gpuswap runtime must have "
        "said hello; after that it is parked as a job without one (e.g. longer for a job that imports a "
        "large framework from a slow file system)", _positive, unit="SECONDS")
    no_runtime: str = _setting(
        "wait", "no-runtime", "for a job that never reaches a safepoint: keep it running (wait) or "
        "SIGSTOP it, which keeps its GPU memory allocated", _choice("wait", "sigstop"), unit="{wait,sigstop}")
    ram_budget: Optional[int] = _setting(
        None, "ram-budget", "host RAM parked jobs may hold", _size, unit="SIZE",
        default_text="half of the machine's RAM", show=_toml_size)
    admin_group: str = _setting(
        "gpuswap-admin", "admin-group", "members may act on all jobs", _string, unit="GROUP")
    dcgm_job_mapping_dir: Optional[Path] = _setting(
        None, "dcgm-job-mapping-dir", "keep dcgm-exporter job-mapping files here "
        "(its --hpc-job-mapping-dir)", _directory, unit="DIR", default_text="none kept")
    listen: Optional[str] = _setting(
        None, "listen", "also serve the API and web dashboard on TCP, with bearer tokens "
        "(`gpuswap token create`)", _listen, unit="HOST:PORT", default_text="the Unix socket only")
    retention_s: Optional[float] = _setting(
        30 * 86400.0, "retention", "forget finished jobs this long after they end: record, events, "
        'output.log and job directory (e.g. 30d, 12h, 90m, 45s, or "never")', _duration,
        unit="DURATION", default_text="30d", show=_toml_duration)
    calibrate: bool = _setting(
        True, "calibrate", "time a disk write (128 MiB, at most a tenth of the free room) and RAM copies at start (with --ray: on every node, "
        "by its agent), for the switch costs' first figures (false: start from defaults, or figures learned from earlier moves; real moves "
        "refine them either way)", _boolean, flag="--no-calibrate",
        flag_help="do not time a 128 MiB disk write and RAM copies at start (with --ray: on any node): "
                  "switch costs start from "
                  "defaults (or figures learned from earlier moves) and are refined by real moves "
                  "(config file: calibrate = false)")


def specs() -> list[tuple[str, Spec, Any]]:
    """(field name, spec, default) of every setting, in declaration order."""
    return [(f.name, f.metadata["spec"], f.default) for f in dataclasses.fields(ServerSettings)]


def default_text(spec: Spec, default: Any) -> str:
    if spec.default_text:
        return spec.default_text
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else str(default)


# -- the sources -----------------------------------------------------------------------------------
def config_file(given: Optional[str], env: Mapping[str, str], home: Path, system_home: Path) -> tuple[Optional[Path], bool]:
    """(path, must_exist): `--config`, else $GPUSWAP_CONFIG (both must exist), else the default
    for this state directory (read only if it exists)."""
    try:
        if given is not None:
            return _expand(given, "--config"), True
        if env.get(envvars.CONFIG):
            return _expand(env[envvars.CONFIG], f"${envvars.CONFIG}"), True
    except ValueError as e:
        raise SettingsError(str(e)) from None
    return (SYSTEM_CONFIG if home == system_home else home / CONFIG_NAME), False


def read_file(path: Optional[Path], must_exist: bool) -> dict[str, Any]:
    """The file's settings as TOML values (checked by `load`), {} for an absent default file."""
    if path is None:
        return {}
    try:
        import tomllib
    except ModuleNotFoundError:     # Python 3.10: the same parser, as a package
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            tomllib = None
    try:
        with _open_config(path) as f:
            if tomllib is None:
                raise SettingsError(f"{path}: reading a config file needs Python 3.11+ or the tomli package")
            return tomllib.load(f)
    except FileNotFoundError:
        if must_exist:
            raise SettingsError(f"{path}: no such config file") from None
        return {}
    except OSError as e:
        # A default config nobody named, under a home that is a file or cannot be entered: the
        # home is the problem, not the config file.
        if not must_exist and e.errno == errno.ENOTDIR:
            raise SettingsError(f"{path.parent}: not a directory") from None
        if not must_exist and e.errno == errno.EACCES and not os.access(path.parent, os.X_OK):
            raise SettingsError(f"{path.parent}: cannot enter the directory: {e.strerror}") from None
        raise SettingsError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    except ValueError as e:      # tomllib.TOMLDecodeError, or bytes that are not UTF-8
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:       # tomllib parses nested arrays and inline tables recursively
        raise SettingsError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None


def _open_config(path: Path) -> BinaryIO:
    """The config file, open, once it is known to be a regular file that only its owner may write.
    O_NONBLOCK: a FIFO (or a device) opens at once rather than waiting for a writer, and is then
    refused by what fstat says of the very file opened, before anything is read from it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SettingsError(f"{path}: is a directory, not a config file")
        if not stat.S_ISREG(st.st_mode):
            raise SettingsError(f"{path}: not a regular file (a FIFO, socket or device), not a config file")
        _check_owner(path, st)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _check_owner(path: Path, st: os.stat_result) -> None:
    """A file that someone other than the daemon's user (or root) may write would let them choose
    its settings (the admin group, the TCP listener): refused, as sshd refuses such a key file."""
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise SettingsError(f"{path}: owned by uid {st.st_uid}; the config file must be owned by root "
                            f"or by the daemon's user (uid {me})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SettingsError(f"{path}: others may write it (mode {stat.S_IMODE(st.st_mode):04o}); "
                            "make it writable by its owner only (chmod go-w)")


def load(flags: Mapping[str, Any], file_values: Mapping[str, Any], path: Optional[Path] = None) -> ServerSettings:
    """Flags (field name -> the flag's value, only those given) over the file's values (key -> TOML
    value) over the defaults, each value read once by its setting's reader."""
    by_key = {spec.key: (name, spec) for name, spec, _ in specs()}
    values: dict[str, Any] = {}
    for key, raw in file_values.items():
        if key not in by_key:
            near = difflib.get_close_matches(key.replace("_", "-"), by_key, n=1)
            hint = ("; settings are keys at the top of the file, not in a table" if isinstance(raw, dict) else
                    f"; did you mean {near[0]!r}?" if near else
                    f"; the keys are: {', '.join(by_key)}")
            raise SettingsError(f"{path}: unknown key {key!r}{hint}")
        name, spec = by_key[key]
        try:
            values[name] = spec.read(raw, key)
        except ValueError as e:
            raise SettingsError(f"{path}: {e}") from None
    for name, spec, _ in specs():
        if name in flags:
            try:
                values[name] = spec.read(flags[name], spec.option)
            except ValueError as e:
                raise SettingsError(str(e)) from None
    return ServerSettings(**values)


def to_toml(settings: ServerSettings, sources: str) -> str:
    """The settings as a config file, each with its help as a comment; one that is not set is
    shown commented out. `gpuswap server --print-config > gpuswap.toml` starts a config file."""
    import textwrap

    lines = [f"# gpuswap server settings ({sources})", "# `gpuswap server --help` says what each does.", ""]
    for name, spec, default in specs():
        literal = spec.show(getattr(settings, name))
        lines += textwrap.wrap(f"{spec.help} (default: {default_text(spec, default)})", 98,
                               initial_indent="# ", subsequent_indent="# ")
        lines += [f"{spec.key} = {literal}" if literal is not None else f"# {spec.key} = (not set)", ""]
    return "\n".join(lines)
