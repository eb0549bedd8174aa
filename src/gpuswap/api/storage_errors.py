"""Failures of the daemon's own storage, answered as such instead of as a 500.

A full disk (SQLite's "database or disk is full", or ENOSPC/EDQUOT from a file write) is the
server's condition, not the client's mistake and not a crash: 507 Insufficient Storage, with a
sentence an operator can act on. Nothing was recorded (the transaction rolled back), so the
request can simply be repeated once there is room.
"""
from __future__ import annotations

import errno
import logging
import sqlite3

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

log = logging.getLogger("gpuswap.api")
FULL = "the daemon's disk is full ({}); nothing was changed: free space under GPUSWAP_HOME and retry"


def disk_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def install(app: FastAPI) -> None:
    """Register the handlers; any other storage error still propagates (and is logged) as before."""

    async def storage(_: Request, exc: Exception) -> JSONResponse:
        if not disk_full(exc):
            raise exc
        log.warning("refused a request: disk full (%s)", exc)
        return JSONResponse({"detail": FULL.format(exc)}, 507)

    app.add_exception_handler(sqlite3.OperationalError, storage)
    app.add_exception_handler(OSError, storage)
