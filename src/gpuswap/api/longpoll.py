"""Long polls that hold no thread. `gpuswap wait` asks the API to answer when its job ends (up to
30 s); its handler once slept on one of anyio's 40 worker threads, so 40 waiting users stopped
every other request (`gpuswap ls` took 24 s). A waiting request is now a coroutine, woken when
the controller ends a tick; one thread relays the ticks to all of them."""
from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from typing import Iterator, Optional


class Ticks:
    """The controller's `changed` condition (notified after every tick), as asyncio events."""

    def __init__(self, changed: threading.Condition):
        self._changed = changed
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._relay_thread: Optional[threading.Thread] = None

    @contextmanager
    def watching(self) -> Iterator[asyncio.Event]:
        """An event set at every tick while the block runs (clear it before each look, then wait)."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters.add(waiter)
            if self._relay_thread is None:
                self._relay_thread = threading.Thread(target=self._relay, name="api-ticks", daemon=True)
                self._relay_thread.start()
        try:
            yield waiter[1]
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _relay(self) -> None:
        while True:
            with self._changed:
                self._changed.wait()
            with self._lock:
                waiters = list(self._waiters)
            for loop, event in waiters:
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:        # its loop has closed (the daemon is stopping)
                    pass
