"""A decided change of one job, as data, and the one place that carries it out.

Observing a job (node/observe.py, and the driver steps in node/freezer.py) decides a `Transition`:
the record's changes, the event that says what happened, and the side effects the change brings
(a bandwidth learned from a move, the processes of a dead supervisor's job to kill, checkpoints
nothing will resume). Deciding reads no clock and writes nothing, so every rule can be tested with
a record and an observation alone; `Applier` writes the change (durably, the lifecycle table
checking the edge) and then performs its effects.
"""
from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from gpuswap import processes
from gpuswap.lifecycle import NewEvent
from gpuswap.node import sessions
from gpuswap.node.bandwidth import Bandwidths
from gpuswap.node.store import Store

log = logging.getLogger("gpuswap.observe")


@dataclass(frozen=True)
class Sample:
    """A real move's figures for the switch-cost model (node/bandwidth.py): `nbytes` moved in
    `seconds` (a bandwidth), or with `nbytes` None a multi-rank group's teardown or rebuild time."""
    field: str
    nbytes: Optional[int]
    seconds: Any


@dataclass(frozen=True)
class KillProcesses:
    """SIGKILL what is left of a job whose supervisor died: its session, and ranks that lead their
    own; only processes its user (`uid`, as submitted: sessions.job_uid) could signal."""
    session: int
    start_ticks: Optional[int]
    uid: int
    ranks: tuple[tuple[int, Optional[int]], ...] = ()


@dataclass(frozen=True)
class RemoveCheckpoints:
    """A completed or cancelled job's checkpoints: nothing will resume them."""
    job_id: int


@dataclass(frozen=True)
class RemoveFile:
    """A node-local file that stood for a step until the step's event was stored (a freeze's
    record beside the job, node/freezer.py): removed after the store, so a failed store leaves it
    and the next tick takes the step up again."""
    path: str


Effect = Union[Sample, KillProcesses, RemoveCheckpoints, RemoveFile]


@dataclass(frozen=True)
class Transition:
    at: float                                   # the time it is recorded at (an exit's own time)
    changes: Mapping[str, Any] = field(default_factory=dict)
    event: Optional[NewEvent] = None
    effects: tuple[Effect, ...] = ()


class Applier:
    """Writes transitions to the store, then performs their effects."""

    def __init__(self, store: Store, bandwidths: Bandwidths, ckpt_dir: Callable[[int], Path],
                 node_bandwidths: Optional[Any] = None):
        self.store, self.bandwidths, self.ckpt_dir = store, bandwidths, ckpt_dir
        # A pool's figures per node (node/nodebandwidths.py): a move is its node's.
        self.node_bandwidths = node_bandwidths
        self._killing: set[int] = set()     # jobs whose orphaned processes are being killed

    def apply(self, job_id: int, t: Transition, node: Optional[Any] = None) -> None:
        """`node`: where the job's node-local effects are performed (node/pool.py's `Node.effect`:
        a pool node's agent); None: here, on this machine."""
        if t.changes or t.event is not None:
            self.store.update(job_id, t.at, event=t.event, **t.changes)
        if t.changes.get("state") is not None:
            self._killing.discard(job_id)
        for e in t.effects:
            if isinstance(e, Sample):
                bw = (self.bandwidths if self.node_bandwidths is None or node is None
                      else self.node_bandwidths.of(node.name))
                if e.nbytes is None:
                    bw.observe_seconds(e.field, e.seconds)
                else:
                    bw.observe(e.field, e.nbytes, e.seconds)
                continue
            if node is not None:
                node.effect(job_id, e)
            else:
                perform(e, self.ckpt_dir)
            if isinstance(e, KillProcesses) and job_id not in self._killing:
                self._killing.add(job_id)
                log.warning("job %d: its supervisor died; killing the processes of its session %d",
                            job_id, e.session)


def perform(e: Effect, ckpt_dir: Callable[[int], Path]) -> None:
    """A transition's node-local effect, on the machine the job runs on."""
    if isinstance(e, KillProcesses):
        uid = sessions.job_uid(e.uid)
        sessions.kill(e.session, e.start_ticks, uid)
        processes.kill_pids(list(e.ranks), uid)
    elif isinstance(e, RemoveCheckpoints):
        shutil.rmtree(ckpt_dir(e.job_id), ignore_errors=True)
    elif isinstance(e, RemoveFile):
        Path(e.path).unlink(missing_ok=True)
