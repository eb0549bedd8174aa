"""Keeping the daemon answering when clients hold connections open (issue 11).

uvicorn (0.54, h11) accepts every connection, never times out one that has sent no request (its
keep-alive timer starts only after a response), and asyncio's accept loop, on EMFILE, logs one
line per pending connection, up to the listen backlog, once a second: 1,100 idle connections
under a 1,024-fd limit left /v1/health unanswered and wrote ~38,000 log lines in 10 s.

So each server gets a connection budget below the process's fd limit (minus a reserve for the
database, job files and spawns, and its listen backlog, which asyncio may accept in one go): at
the budget, a new connection evicts the oldest one with no request in flight (an idle or
slowloris one), so a real request still gets through; a connection that has not sent a whole
request within IDLE_TIMEOUT_S (from its start, or from its last response) is closed. Reaching
the budget is logged once per episode, and asyncio's accept complaint at most once a minute.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Callable, Optional

log = logging.getLogger("gpuswap.connections")

IDLE_TIMEOUT_S = 10.0     # to send a whole request (headers and body), from connect or last response
KEEP_ALIVE_S = 5          # uvicorn's idle time after a response
BACKLOG = 16              # per listener; asyncio may accept this many at once before we see them
RESERVE_MIN = 64          # fds for SQLite, job files, spawns, logs
MAX_CONNECTIONS = 4096    # per listener, whatever the fd limit (memory)


def connection_budget(listeners: int, nofile: Optional[int] = None) -> int:
    """Connections each listener may hold so that, with backlogs and the reserve, the process
    stays below its soft RLIMIT_NOFILE."""
    soft = nofile if nofile is not None else resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 20
    # Twice the backlog: one batch just accepted, and the previous batch's evicted connections,
    # whose sockets the loop closes on its next turn.
    spare = soft - max(RESERVE_MIN, soft // 8) - 2 * BACKLOG * listeners
    return max(8, min(MAX_CONNECTIONS, spare // listeners))


class ConnectionGuard:
    """One listener's open connections, oldest first. Used from that server's event loop only."""

    def __init__(self, name: str, cap: int):
        self.name, self.cap = name, cap
        self.open: dict[Any, None] = {}        # insertion order = age
        self.episode = False
        self.evicted = self.refused = 0

    def admit(self, conn: Any) -> bool:
        if len(self.open) >= self.cap:
            if not self.episode:
                self.episode = True
                log.warning("%s: %d connections open, the most it serves within its file-descriptor "
                            "limit; closing the oldest idle ones (logged once until it clears)",
                            self.name, len(self.open))
            victim = next((c for c in self.open if c.idle()), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            victim.close_now()
            self.open.pop(victim, None)
        self.open[conn] = None
        return True

    def release(self, conn: Any) -> None:
        self.open.pop(conn, None)
        if self.episode and len(self.open) <= self.cap // 2:
            log.warning("%s: back to %d connections; %d idle connection(s) were closed and %d refused "
                        "while at the limit", self.name, len(self.open), self.evicted, self.refused)
            self.episode, self.evicted, self.refused = False, 0, 0


class GuardedMixin:
    """Mixed in before uvicorn's H11Protocol: admission by the guard, and the request deadline."""

    guard: ConnectionGuard

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)   # type: ignore[misc]
        self._deadline: Optional[asyncio.TimerHandle] = None
        if not self.guard.admit(self):
            self.close_now()
            return
        self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.guard.release(self)
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)   # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()   # type: ignore[misc]
        self._arm()

    def idle(self) -> bool:
        """No request being served: nothing sent yet, a partial request, or between requests."""
        cycle = getattr(self, "cycle", None)
        return cycle is None or cycle.response_complete or cycle.more_body

    def close_now(self) -> None:
        transport = getattr(self, "transport", None)
        if transport is not None and not transport.is_closing():
            transport.close()

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(IDLE_TIMEOUT_S, self._expire)   # type: ignore[attr-defined]

    def _expire(self) -> None:
        self._deadline = None
        if self.idle():
            self.close_now()


def guarded(protocol: type, guard: ConnectionGuard) -> type:
    """`protocol` (an H11Protocol class) with `guard`'s admission and the request deadline."""
    return type(f"Guarded{protocol.__name__}", (GuardedMixin, protocol), {"guard": guard})


def server_limits(guard: ConnectionGuard) -> dict[str, Any]:
    """uvicorn.Config arguments that go with a guard: a short backlog, keep-alive, and (as a
    second line) 503s past the budget in requests in flight."""
    return {"backlog": BACKLOG, "timeout_keep_alive": KEEP_ALIVE_S, "limit_concurrency": guard.cap + 8}


class OncePerMinute(logging.Filter):
    """Of the records whose message holds `fragment`, let one through a minute, rewritten by `say`
    (with how many were held back since the last one). For messages a client or the kernel can
    repeat without end: asyncio logs 'socket.accept() out of system resource' for each pending
    connection every second while fds are exhausted; uvicorn logs 'Invalid HTTP request received.'
    for each malformed request, which anyone who reaches --listen may send (one WARNING line each:
    an unbounded log)."""

    def __init__(self, fragment: str, say: Callable[[logging.LogRecord], str]) -> None:
        super().__init__()
        self.fragment, self.say = fragment, say
        self.last = float("-inf")
        self.held_back = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.fragment not in str(record.msg):
            return True
        now = time.monotonic()
        if now - self.last < 60.0:
            self.held_back += 1
            return False
        self.last = now
        more = f"; {self.held_back} more held back since the last such line" if self.held_back else ""
        record.msg = f"{self.say(record)} (said at most once a minute{more})"
        record.args, record.exc_info, record.exc_text = (), None, None
        self.held_back = 0
        return True


def _accept_error(record: logging.LogRecord) -> str:
    exc = record.exc_info[1] if record.exc_info else None
    return f"{str(record.msg).splitlines()[0]}: {exc or 'no file descriptors'}; new connections wait"


def quiet_accept_errors() -> None:
    """The two floods above, each said at most once a minute. (uvicorn's logging set-up keeps a
    logger's filters: its dictConfig does not remove them.)"""
    logging.getLogger("asyncio").addFilter(OncePerMinute("out of system resource", _accept_error))
    logging.getLogger("uvicorn.error").addFilter(OncePerMinute(
        "Invalid HTTP request received", lambda r: "Invalid HTTP request received: answered 400"))
