"""A job's record as the store reads and writes it: the typed row of `jobs` (with its argv from
`job_specs`), and how its fields map to columns (JSON lists and objects, 0/1 booleans, states)."""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, Optional

from gpuswap.jobs import JobState
from gpuswap.lifecycle import Parked

_JSON_COLUMNS = {"argv", "env", "assigned", "home_gpus", "residue", "ranks"}
_BOOL_COLUMNS = {"preemptible", "hold", "no_runtime", "stopped", "cancel_requested", "attached"}


@dataclass
class JobRecord:
    """One row of `jobs`, typed. Field names are the column names."""

    id: int
    name: str
    user: str
    uid: int
    gid: int
    argv: list[str]
    cwd: str
    priority: int
    gpus: int
    mem_bytes: int
    preemptible: bool
    state: JobState
    reason: str
    exit_code: Optional[int]
    signal: Optional[int]
    submit_time: float
    state_since: float
    last_start: Optional[float]
    end_time: Optional[float]
    attained_gpu_s: float
    run_s: float
    switch_s: float
    assigned: list[int]
    home_gpus: list[int]
    parked: Optional[str]
    parked_bytes: int
    device_bytes: int
    generation: int
    desired: str
    desired_tier: Optional[str]
    pause_requested_at: Optional[float]
    hold: bool
    no_runtime: bool
    stopped: bool
    cancel_requested: bool
    preemptions: int
    step: Optional[int]
    pause_mode: str          # auto | cooperative | transparent, as submitted
    mechanism: Optional[str]  # how the current/last park is done: cooperative | transparent
    attached: bool           # its gpuswap runtime said hello
    transparent_refused: Optional[str]  # why the driver path cannot park this job, once found out
    abort_reason: Optional[str]  # the daemon is stopping the job because of this; it ends FAILED
    ram_allowance: Optional[int]  # most bytes its RAM park may take (what the budget has left)
    # GPU -> bytes its processes still held there when its last cooperative RAM park completed
    # (NVML, node/residue.py): while it is parked in RAM, memory still taken on its GPUs.
    residue: dict[int, int]
    # A multi-rank job's ranks as its supervisor last listed them ([] for a single-rank job):
    # [{"rank", "pid", "state", "connected", "device_bytes"}] (runtime/ranktable.py), for `show` and `ls`.
    ranks: list[dict[str, Any]]
    version: int             # store-wide change counter at this row's last write
    # Ranks of its process group, as its runtime reported them (`world_size`); 1 until one does.
    # How it can be parked and at what cost follow from it (policy/capability.py).
    width: int = 1
    # Why its ranks cannot rebuild their process group (their runtime said so): parked to disk only.
    ram_refusal: Optional[str] = None
    # The user's intent, as the API records it (the controller's columns are `desired*`): where a
    # held job is to be parked, ram | disk (None: RAM). Meaningful while `hold` is set.
    hold_tier: Optional[str] = None
    # Runtime estimate (policy/estimate.py), made once at submission from the user's --time or the
    # runs finished before it: run-seconds in all, from "time" | "name" | "user", over how many runs.
    time_limit_s: Optional[float] = None
    estimate_s: Optional[float] = None
    estimate_from: Optional[str] = None
    estimate_runs: int = 0
    # The node of a pool (docs/ray.md) it runs or is parked on, with `assigned` and `home_gpus` that
    # node's own GPU indices; None on a single machine (and before a pool starts it).
    node: Optional[str] = None

    @property
    def holds_gpu(self) -> bool:
        """Its memory is on its GPUs: started and not parked (a SIGSTOPped job still holds it)."""
        if self.state in (JobState.RUNNING, JobState.PAUSING, JobState.RESUMING):
            return True
        return self.state == JobState.PAUSED and self.stopped and self.parked is None

    @property
    def parked_state(self) -> Optional[Parked]:
        """Where its GPU state is parked (tier, mechanism, bytes, home GPUs), None when nothing is."""
        return Parked.of(self)

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> "JobRecord":
        values = list(row)
        for i in _JSON_INDEXES:
            v = values[i]
            values[i] = [] if v in ("[]", "{}", None) else json.loads(v)   # most rows: no GPUs, no residue
        res = values[_RESIDUE_INDEX]          # JSON object keys are strings: GPU indices again
        values[_RESIDUE_INDEX] = {int(g): int(n) for g, n in res.items()} if isinstance(res, dict) else {}
        for i in _BOOL_INDEXES:
            values[i] = bool(values[i])
        values[_STATE_INDEX] = JobState(values[_STATE_INDEX])
        return cls(*values)


_RECORD_FIELDS = [f.name for f in fields(JobRecord)]
# argv lives in job_specs (node/schema.py); every query that builds records reads `RECORD_FROM`.
RECORD_COLUMNS = ", ".join("s.argv" if n == "argv" else f"j.{n}" for n in _RECORD_FIELDS)
RECORD_FROM = "jobs j LEFT JOIN job_specs s ON s.job_id = j.id"
RECORD_COLUMNS_NO_ARGV = RECORD_COLUMNS.replace("s.argv", "'[]'")
_JSON_INDEXES = [i for i, n in enumerate(_RECORD_FIELDS) if n in _JSON_COLUMNS]
_BOOL_INDEXES = [i for i, n in enumerate(_RECORD_FIELDS) if n in _BOOL_COLUMNS]
_STATE_INDEX = _RECORD_FIELDS.index("state")
_RESIDUE_INDEX = _RECORD_FIELDS.index("residue")


@dataclass(frozen=True)
class Event:
    time: float
    state: str
    reason: str
    # What it records (gpuswap.lifecycle.EventKind's value), where to and how, and who asked: NULL
    # on rows written before they were recorded that no wording rule matched (node/schema.py).
    kind: Optional[str] = None
    tier: Optional[str] = None
    mechanism: Optional[str] = None
    initiator: Optional[str] = None


class EventRow(NamedTuple):
    """A row of the events table as the metrics fold it (Store.events_after)."""
    id: int
    job_id: int
    time: float
    state: str
    reason: str
    initiator: Optional[str]
    kind: Optional[str]
    tier: Optional[str]
    mechanism: Optional[str]


@dataclass
class NewJob:
    name: str
    user: str
    uid: int
    gid: int
    argv: list[str]
    cwd: str
    env: dict[str, str]
    priority: int
    gpus: int
    mem_bytes: int
    preemptible: bool = True
    pause_mode: str = "auto"
    time_limit_s: Optional[float] = None     # --time
    estimate_s: Optional[float] = None       # policy/estimate.py, made at submission
    estimate_from: Optional[str] = None
    estimate_runs: int = 0


def encode(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS:
        return json.dumps(value)
    if column in _BOOL_COLUMNS:
        return int(bool(value))
    if isinstance(value, JobState):
        return value.value
    return value
