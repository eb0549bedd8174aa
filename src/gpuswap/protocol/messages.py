"""What a job may tell its supervisor, typed and bounded: the one gate for job-supplied values.

Everything on the control socket comes from the job, and the supervisor (root) copies it into
`status.json`, which the daemon folds into SQLite. An unbounded integer there (SQLite INTEGER is
64-bit) once made every controller tick fail for every user. So each control message is validated
here where it is received (`parse`), and the runtime facts are validated again, with the same
bounds, where the daemon reads them back (status.py): a supervisor of an older version, still
running across an upgrade, may have written anything. A value that fails costs its job (ignored),
never the loop. The framing (one JSON object per line) is channel.py's, the records (one per kind
of message, what `parse` returns) records.py's, and the bounds of every field bounds.py's.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError

from gpuswap.protocol.bounds import MAX_LINE  # noqa: F401  (the readers bound their lines by it)
from gpuswap.protocol.records import REPORTS, Report

OPS = frozenset(REPORTS)
RANK_OPS = frozenset({"usage", "paused", "resumed", "error", "mark", "hold", "ready", "unparked", "part",
                      "committed", "done"})
# The gate: each record's fields checked against their bounds (bounds.py) before the record exists;
# a key no record has is ignored.
_GATE: TypeAdapter[Report] = TypeAdapter(Annotated[Report, Field(discriminator="op")])


class BadMessage(ValueError):
    """A control line that is not a valid message (the runtime ships with the supervisor, so an
    unknown op is as invalid as any other)."""


def parse(line: bytes) -> Report:
    """One control line -> its validated record (records.py), or BadMessage saying why (one short line)."""
    try:
        return _GATE.validate_json(line)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in err["loc"][1:] if p)
        raise BadMessage(f"{where + ': ' if where else ''}{err['msg']}"[:200]) from None
