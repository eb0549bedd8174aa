"""The supervisor's side of a multi-rank job: one control connection per rank, and the coordinator.

The protocol is `runtime/agreement.py` (pure: facts in, `Send`/`Kill` effects out); this module is
the socket side of it. Each connection is tied to the rank its `hello` named, and to the process
the *kernel* says is at its other end (SO_PEERCRED pid, with its start time so a reused pid is
never taken for it). Those processes are what the supervisor and the daemon kill when the job
ends or cannot go on: torchrun starts each worker as a session leader of its own, outside the
session the supervisor kills (docs/design/multi-rank.md section 0).

The disk tier of a multi-rank job is not built yet (`disk_refusal` says why): a disk pause or a
spill is refused here, before any rank is asked, and a RAM park that would have to become a disk
park (a rank that cannot rebuild its group, more bytes than the RAM budget) is refused with that
reason. Nothing unsafe is attempted.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuswap.node import messages, sessions
from gpuswap.runtime import channel
from gpuswap.runtime.agreement import PARKED, REGROUPING, UNPARKING, Coordinator, Effect, Kill, Send

DISK_NOT_BUILT = "disk parking of multi-rank jobs is not supported yet"


@dataclass(frozen=True)
class RankProcess:
    rank: int
    pid: int
    start_ticks: Optional[int]


def disk_refusal() -> Optional[str]:
    """The seam the multi-rank disk tier fills: None once ranks can write their parts and rank 0
    the manifest (runtime/ranks.py `write_part`)."""
    return DISK_NOT_BUILT


class RankTable:
    """Connections by rank, the processes behind them, and the job's coordinator. Every method is
    called under the supervisor's lock; `Send`s go out at once, a `Kill` goes to `on_kill`."""

    def __init__(self, timeout_s: float, on_kill: Callable[[str], None], log: Callable[[str], None]) -> None:
        self.coord = Coordinator(timeout_s)
        self.on_kill, self.log = on_kill, log
        self.conns: dict[socket.socket, int] = {}
        self.by_rank: dict[int, socket.socket] = {}
        self.processes: dict[int, RankProcess] = {}      # by pid: every process that was a rank
        self._wanted: Optional[tuple[Any, ...]] = None

    # -- inputs ------------------------------------------------------------------------------
    def hello(self, conn: socket.socket, msg: messages.Hello, peer_pid: Optional[int], now: float) -> bool:
        """A rank said who it is. False: the connection is refused (a second live process claiming
        a rank, or a world size that disagrees) and must be closed."""
        rank, world = msg.rank if msg.rank is not None else 0, msg.world_size or 1
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
        if peer_pid is not None and peer_pid not in self.processes:
            self.processes[peer_pid] = RankProcess(rank, peer_pid, sessions.start_ticks(peer_pid))
        self.route(effects)
        return True

    def receive(self, conn: socket.socket, msg: messages.Message, now: float) -> None:
        rank = self.conns.get(conn)
        if rank is None:
            return
        self.route(self.coord.receive(rank, msg.model_dump(exclude_none=True), now))

    def lost(self, conn: socket.socket, now: float) -> None:
        rank = self.conns.pop(conn, None)
        if rank is None or self.by_rank.get(rank) is not conn:
            return
        del self.by_rank[rank]
        self.route(self.coord.lost(rank, now))

    def poll(self, now: float) -> None:
        self.route(self.coord.poll(now))

    def want(self, desired: dict[str, Any], now: float) -> None:
        """The daemon's desired.json, given to the coordinator when it changed (the coordinator
        withdraws a failed attempt and waits to be asked again: a repeated `want` would loop)."""
        run, tier, cap = desired.get("run"), desired.get("tier"), desired.get("max_bytes")
        key = (run, tier, cap if isinstance(cap, int) else None)
        if key == self._wanted:
            return
        self._wanted = key
        if run == "paused" and tier in ("ram", "disk"):
            why = self._refusal(tier, key[2])
            if why is not None:
                self.coord.error, self.coord.error_at = why, now
                self.log(why)
                return
            self.route(self.coord.want("paused", tier, now, max_bytes=key[2]))
        else:
            self.route(self.coord.want("running", None, now))

    def _refusal(self, tier: str, cap: Optional[int]) -> Optional[str]:
        disk = disk_refusal()
        if disk is None:
            return None
        if tier == "disk":
            what = "spill to disk" if self.coord.phase == PARKED else "pause to disk"
            return f"{what} refused: {disk}"
        refusals = [f"rank {r.rank}: {r.ram_refusal}" for r in self.coord.ranks.values() if r.ram_refusal]
        if refusals:
            return (f"pause to RAM refused: cannot rebuild the process group ({'; '.join(refusals)}), "
                    f"and {disk}")
        total = sum(r.device_bytes for r in self.coord.ranks.values())
        if cap is not None and total > cap:
            return f"pause to RAM refused: {total} bytes exceed the RAM budget's {cap}, and {disk}"
        return None

    # -- effects -----------------------------------------------------------------------------
    def route(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Send):
                conn = self.by_rank.get(e.rank)
                if conn is None:
                    continue
                try:
                    conn.sendall(channel.encode(e.msg))
                except OSError:
                    pass      # its reader sees the close: `lost`
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
        return out

    def pid_records(self) -> list[dict[str, Any]]:
        return [{"rank": p.rank, "pid": p.pid, "start_ticks": p.start_ticks} for p in self.processes.values()]

    def kill_all(self) -> int:
        """SIGKILL every process that was a rank and still is; how many were alive."""
        return sessions.kill_pids([(p.pid, p.start_ticks) for p in self.processes.values()])
