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

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from gpuswap.fsutil import atomic_write_json, read_json

SPEC = "spec.json"
DESIRED = "desired.json"
SPAWNED = "spawned.json"
STATUS = "status.json"
LOCK = "lock"
CONTROL = "control"
SUPERVISOR_LOG = "supervisor.log"
SUPERVISOR_ERR = "supervisor.err"
TRANSPARENT = "transparent.json"

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
        """The daemon's file, whatever version wrote it: an unknown value is the default's."""
        if not isinstance(raw, dict):
            return cls()
        run = raw.get("run")
        tier = raw.get("tier")
        return cls(run=run if run in ("running", "paused") else "running",
                   tier=tier if isinstance(tier, str) else None, sigstop=bool(raw.get("sigstop")),
                   cancel=bool(raw.get("cancel")), max_bytes=_int_or_none(raw.get("max_bytes")))


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


def read_desired(run: Path) -> Optional[Desired]:
    raw = read_json(run / DESIRED)
    return None if raw is None else Desired.from_json(raw)


def read_spec(run: Path) -> Spec:
    return Spec.from_json(read_json(run / SPEC))


def read_spawned(run: Path) -> Optional[Spawned]:
    return Spawned.from_json(read_json(run / SPAWNED))
