"""The coordinator's side of a multi-rank job: one control connection per rank, and the coordinator.

Run by the job's supervisor (node/supervisor.py) or, under Slurm, inside the job
(runtime/slurmcoord.py); here, below both, so the runtime never imports the daemon's side. The
protocol is `agreement.py` (pure: facts in, `Send`/`Kill` effects out); this module is the socket
side of it. Each connection is tied to the rank its `hello` named, and to the process
the *kernel* says is at its other end (SO_PEERCRED pid, with its start time so a reused pid is
never taken for it). Those processes are what the supervisor and the daemon kill when the job
ends or cannot go on: torchrun starts each worker as a session leader of its own, outside the
session the supervisor kills (docs/design/multi-rank.md section 0).

A disk park (or a spill from RAM, or a RAM park that must become one: a rank that cannot rebuild
its group, more bytes than the RAM budget) is the coordinator's: every rank writes its part, rank 0
the manifest, and once it is committed the job's verdict is "checkpointed" whatever the launcher's
exit code (torchrun turns a rank's 75 into its own 1; design section 4).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuswap import processes
from gpuswap.protocol import channel, records
from gpuswap.protocol.bounds import MAX_WORLD
from gpuswap.protocol.rundir import Desired
from gpuswap.runtime.agreement import REGROUPING, UNPARKING, Coordinator, Effect, Kill, Send


# Processes a job's ranks may have been, over one launch: every rank of the largest world, a few
# times over (a rank that reconnects is the same process). Without a bound, a job that kept
# connecting from new processes grew the table, and status.json, without end.
MAX_PROCESSES = 4 * MAX_WORLD


@dataclass(frozen=True)
class RankProcess:
    rank: int
    pid: int
    start_ticks: Optional[int]


class RankTable:
    """Connections by rank, the processes behind them, and the job's coordinator. Every method is
    called under the supervisor's lock; `Send`s go out at once, a `Kill` goes to `on_kill`."""

    def __init__(self, timeout_s: float, on_kill: Callable[[str], None], log: Callable[[str], None],
                 uid: Optional[int] = None) -> None:
        self.coord = Coordinator(timeout_s)
        self.on_kill, self.log = on_kill, log
        self.uid = uid        # the job's, where root kills its ranks (the supervisor); None in the job
        self.conns: dict[socket.socket, int] = {}
        self.by_rank: dict[int, socket.socket] = {}
        self.processes: dict[int, RankProcess] = {}      # by pid: every process that was a rank
        self._wanted: Optional[tuple[Any, ...]] = None
        self.restored: dict[int, records.Hello] = {}    # each rank's last hello: what it restored

    # -- inputs ------------------------------------------------------------------------------
    def hello(self, conn: socket.socket, msg: records.Hello, peer_pid: Optional[int], now: float,
              peer_ticks: Optional[int] = None) -> bool:
        """A rank said who it is. False: the connection is refused (a second live process claiming
        a rank, a world size that disagrees, or more processes than MAX_PROCESSES) and must be
        closed. `peer_pid`, `peer_ticks`: the connecting process and its start time, read when the
        connection was accepted; a process already gone then (no start time) is never recorded as
        the rank's: only a (pid, start time) pair is ever killed."""
        rank, world = msg.rank if msg.rank is not None else 0, msg.world_size or 1
        if peer_pid is not None and peer_pid not in self.processes and len(self.processes) >= MAX_PROCESSES:
            return False
        effects = self.coord.hello(rank, world, now, pid=peer_pid, epoch=msg.epoch, state=msg.state or "running",
                                   ram_refusal=msg.ram_refusal)
        r = self.coord.ranks.get(rank)
        if r is None or r.pid != peer_pid or not r.connected or world != self.coord.world_size:
            self.route(effects)
            return False
        r.device_bytes = 0 if msg.parked else msg.device_bytes
        old = self.by_rank.get(rank)
        if old is not None and old is not conn:
            self.conns.pop(old, None)
        self.conns[conn], self.by_rank[rank] = rank, conn
        if peer_pid is not None and peer_ticks is not None and peer_pid not in self.processes:
            self.processes[peer_pid] = RankProcess(rank, peer_pid, peer_ticks)
        self.restored[rank] = msg
        self.route(effects)
        other = next((h for r, h in sorted(self.restored.items()) if h.restored_seq != msg.restored_seq), None)
        if other is not None:     # the ranks would train on from different steps: never
            self.route([Kill(f"the ranks restored different checkpoints (rank {other.rank}: "
                             f"{_seq(other.restored_seq)}, rank {rank}: {_seq(msg.restored_seq)})")])
        return True

    def receive(self, conn: socket.socket, msg: records.Report, now: float) -> None:
        rank = self.conns.get(conn)
        if rank is None:
            return
        self.route(self.coord.receive(rank, msg, now))

    def lost(self, conn: socket.socket, now: float) -> None:
        rank = self.conns.pop(conn, None)
        if rank is None or self.by_rank.get(rank) is not conn:
            return
        del self.by_rank[rank]
        self.route(self.coord.lost(rank, now))

    def poll(self, now: float) -> None:
        self.route(self.coord.poll(now))

    def want(self, desired: Desired, now: float) -> None:
        """The daemon's desired.json, given to the coordinator when it changed (the coordinator
        withdraws a failed attempt and waits to be asked again: a repeated `want` would loop)."""
        key = (desired.run, desired.tier, desired.max_bytes)
        if key == self._wanted:
            return
        self._wanted = key
        if desired.pause_tier is not None:
            self.route(self.coord.want("paused", desired.pause_tier, now, max_bytes=desired.max_bytes))
        else:
            self.route(self.coord.want("running", None, now))

    # -- effects -----------------------------------------------------------------------------
    def route(self, effects: list[Effect]) -> None:
        # One line per attempt's turn (not per message): what a stuck pause is read from.
        told = sorted({e.msg.op for e in effects if isinstance(e, Send)})
        if told:
            self.log(f"phase {self.coord.phase}, epoch {self.coord.epoch}: sent {', '.join(told)}"
                     + (f" ({self.coord.error})" if self.coord.error else ""))
        for e in effects:
            if isinstance(e, Send):
                conn = self.by_rank.get(e.rank)
                if conn is not None:
                    channel.send_or_drop(conn, records.encode(e.msg), self.log, "a rank's")
            elif isinstance(e, Kill):
                self.log(f"ending the job: {e.reason}")
                self.on_kill(e.reason)

    # -- facts -------------------------------------------------------------------------------
    def facts(self) -> dict[str, Any]:
        """status.json's `runtime` for a multi-rank job, in the single-rank vocabulary the daemon
        reads (state running/paused/checkpointed, tier, bytes, ...) plus the ranks."""
        out = self.coord.facts()
        if self.coord.phase in (UNPARKING, REGROUPING):
            out["state"] = "paused"       # still parked until every rank has regrouped
        out["connected"] = any(r.connected for r in self.coord.ranks.values())
        zero = self.coord.ranks.get(0)
        if zero is not None and zero.step is not None:
            out["step"] = zero.step
        why = self.coord.pausable()
        if why is not None:
            out["not_pausable"] = why
        if out.get("why_disk"):      # a RAM park became this disk park: the daemon's event says why
            out["ckpt_note"] = f"RAM park refused: {out.pop('why_disk')}"
        first = self.restored.get(0)
        if first is not None:        # what the ranks restored at attach (all the same checkpoint)
            out.update(restored_step=first.restored_step, restored_bytes=first.restored_bytes,
                       restore_note=first.restore_note, restored_seq=first.restored_seq,
                       restore_s=max((h.restore_s or 0.0 for h in self.restored.values()), default=0.0)
                       if first.restore_s is not None else None)
        return out

    def pid_records(self) -> list[dict[str, Any]]:
        return [{"rank": p.rank, "pid": p.pid, "start_ticks": p.start_ticks} for p in self.processes.values()]

    def kill_all(self) -> int:
        """SIGKILL every process that was a rank and still is; how many were alive."""
        return processes.kill_pids([(p.pid, p.start_ticks) for p in self.processes.values()], self.uid)


def _seq(seq: Optional[int]) -> str:
    return f"checkpoint {seq}" if seq is not None else "none"
