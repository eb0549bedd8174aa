"""The numbers of the size limits (docs/limits.md), apart from api/limits.py's checks so that the
CLI can read them without importing the daemon's web stack: it refuses a body over the limit
before sending it, rather than having the daemon cut it off mid-send."""
from __future__ import annotations

KiB = 1024
MAX_BODY_BYTES = 1024 * KiB           # one request body (JSON as sent)
MAX_HEADER_BYTES = 16 * KiB           # a request's headers, names and values together
MAX_ARGV_ITEMS = 4096
MAX_ARGV_BYTES = 256 * KiB            # sum of the UTF-8 arguments, each with its NUL
MAX_ENV_VARS = 4096
MAX_ENV_BYTES = 256 * KiB             # sum of NAME=VALUE, each with its NUL
MAX_STRING_BYTES = 128 * KiB          # one argument or NAME=VALUE with its NUL: Linux's MAX_ARG_STRLEN
MAX_NAME_CHARS = 200
MAX_CWD_CHARS = 4096                  # PATH_MAX
MAX_PAGE_JOBS = 1000                  # jobs in one GET /v1/jobs page
PAGE_ARGV_BYTES = 4 * 1024 * KiB      # argv bytes in one page (at least one job)
TOKEN_ID_HEX_DIGITS = 12              # a token's public id (secrets.token_hex(6)), as `token ls` shows it


def size_text(n: int) -> str:
    """`n` bytes for a person: "1 MiB", "128 KiB", "1.50 KiB", "12 bytes"."""
    if n >= KiB * KiB and n % (KiB * KiB) == 0:
        return f"{n // (KiB * KiB)} MiB"
    if n >= KiB:
        return f"{n // KiB} KiB" if n % KiB == 0 else f"{n / KiB:.2f} KiB"
    return f"{n} bytes"


def body_too_large(limit: int = MAX_BODY_BYTES) -> str:
    """The one sentence a body over the limit is refused with, by the daemon (413) and the CLI."""
    return f"request body too large: the limit is {size_text(limit)}"
