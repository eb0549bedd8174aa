"""The files of a launch's run directory (`jobs/ID/run-GEN/`), and the records the daemon and the
supervisor pass through them.

  spec.json      daemon -> supervisor: what to run (`Spec`), written once before the spawn
  desired.json   daemon -> supervisor: what the daemon wants now (`Desired`), rewritten on change
  spawned.json   the daemon's mark that the supervisor process exists (`Spawned`)
  status.json    supervisor -> daemon: what is (status.py: node/supervisor.py writes its
                 `SupervisorStatus`, the daemon reads a `SupervisorReport`, every field validated)
  lock           flocked by the supervisor for its whole life: the daemon's liveness check
  control        the job's control socket (channel.py), the job owner's
  supervisor.log, supervisor.err   the supervisor's own lines, and its stderr
  transparent.json   a transparent freeze's record (node/transparent.py)

Every file is written atomically (gpuswap.fsutil): a reader sees the old content or the new. A
field a reader does not know is ignored and a missing one takes its default, so a daemon and a
supervisor of neighbouring versions (a supervisor outlives an upgrade) still understand each other.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from gpuswap.fsutil import atomic_write_json, read_json, read_small

SPEC = "spec.json"
DESIRED = "desired.json"
SPAWNED = "spawned.json"
STATUS = "status.json"
LOCK = "lock"
CONTROL = "control"
SUPERVISOR_LOG = "supervisor.log"
SUPERVISOR_ERR = "supervisor.err"
TRANSPARENT = "transparent.json"

MAX_DESIRED = 64 << 10     # desired.json is ~100 bytes: a larger one is not the daemon's

RunWanted = Literal["running", "paused"]


def _int_or_none(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class Desired:
    """What the daemon wants of a launch now (node/controller.py), carried out by its supervisor."""
    run: RunWanted = "running"
    tier: Optional[str] = None          # "ram" | "disk" when run is "paused"
    sigstop: bool = False               # the fallback for a job that cannot park: stop its process group
    cancel: bool = False
    max_bytes: Optional[int] = None     # a RAM park: what the host-RAM budget has left for it

    @property
    def pause_tier(self) -> Optional[str]:
        """The tier of a pause asked for, if one is (a paused run with a tier it knows)."""
        return self.tier if self.run == "paused" and self.tier in ("ram", "disk") else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> "Desired":
        """The daemon's file, whatever version wrote it: a missing key or an unknown value (a run
        state or tier a newer daemon added) is the default's. ValueError (why) for what no version
        writes: not a non-empty object, or a value of the wrong type. Such a file is no wish at
        all rather than its defaults, which would resume, continue or stop the job by accident."""
        if not isinstance(raw, dict) or not raw:
            raise ValueError("not a JSON object with fields")
        for key, ok in (("run", lambda v: isinstance(v, str)), ("tier", lambda v: v is None or isinstance(v, str)),
                        ("sigstop", lambda v: isinstance(v, bool)), ("cancel", lambda v: isinstance(v, bool)),
                        ("max_bytes", lambda v: v is None or _int_or_none(v) is not None)):
            if key in raw and not ok(raw[key]):
                raise ValueError(f"{key!r} is a {type(raw[key]).__name__}")
        run, tier = raw.get("run"), raw.get("tier")
        return cls(run=run if run in ("running", "paused") else "running", tier=tier,
                   sigstop=raw.get("sigstop", False), cancel=raw.get("cancel", False), max_bytes=raw.get("max_bytes"))


@dataclass(frozen=True)
class Spec:
    """What a launch runs, and as whom (node/launcher.py writes it, node/supervisor.py reads it)."""
    job_id: int
    generation: int
    argv: list[str]
    cwd: str
    env: dict[str, str]                 # the submitter's environment
    extra_env: dict[str, str]           # what the daemon adds: the GPUs, and env.JobEnv's variables
    uid: int
    gid: int
    log_path: str
    control: str                        # the control socket's address (channel.py)
    groups: list[int] = field(default_factory=list)
    pause_timeout_s: float = 60.0       # a multi-rank job's supervisor bounds each phase by it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Spec":
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        known["groups"] = raw.get("groups") or []
        known["pause_timeout_s"] = float(raw.get("pause_timeout_s") or 60.0)
        return cls(**known)


@dataclass(frozen=True)
class Spawned:
    """The daemon's mark, written once the supervisor process exists."""
    pid: int
    time: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> Optional["Spawned"]:
        if not isinstance(raw, dict) or not isinstance(raw.get("time"), (int, float)):
            return None
        return cls(pid=raw.get("pid") if isinstance(raw.get("pid"), int) else 0, time=float(raw["time"]))


def write(run: Path, name: str, record: Any) -> None:
    """One of the records above into its file in `run`, atomically."""
    atomic_write_json(run / name, record.to_json())


def load_desired(run: Path) -> Desired:
    """desired.json, read as something the daemon alone writes but that must never be trusted to
    be sane: OSError (absent, gone, not a regular file, a link, over MAX_DESIRED bytes) or
    ValueError (not JSON, not `Desired`'s record) says why it is not one."""
    data = read_small(run / DESIRED, MAX_DESIRED)
    try:
        raw = json.loads(data)
    except RecursionError:                  # nested too deep to be the daemon's
        raise ValueError("not JSON") from None
    except ValueError as e:                 # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"not JSON: {str(e)[:80]}") from None
    return Desired.from_json(raw)


def read_desired(run: Path) -> Optional[Desired]:
    """desired.json as the daemon reads it back: None if absent or not a usable record (the
    daemon then writes its wish again)."""
    try:
        return load_desired(run)
    except (OSError, ValueError):
        return None


def read_spec(run: Path) -> Spec:
    return Spec.from_json(read_json(run / SPEC))


def read_spawned(run: Path) -> Optional[Spawned]:
    return Spawned.from_json(read_json(run / SPAWNED))
