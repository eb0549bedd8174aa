"""Bearer tokens for the TCP listener, where no kernel can tell us who is calling.

A token is `gst_<id>_<secret>`: the id finds the row, the 32-byte secret is checked against its
stored sha256 with a constant-time compare. Only the digest is stored, so a copy of state.db
does not let anyone act as a user. Tokens are created over the Unix socket, where the caller's
identity comes from SO_PEERCRED, and map to a uid: the same authorization rules then apply.
"""
from __future__ import annotations

import hashlib
import hmac
import pwd
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Optional

from gpuswap.api.sizes import TOKEN_ID_HEX_DIGITS
from gpuswap.node.store import Store

PREFIX = "gst"
_TOKEN = re.compile(rf"^gst_([0-9a-f]{{{TOKEN_ID_HEX_DIGITS}}})_([A-Za-z0-9_-]{{43}})$")


@dataclass(frozen=True)
class TokenOwner:
    uid: int
    user: str


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenBook:
    """Creates, checks and revokes tokens in the daemon's store."""

    def __init__(self, store: Store):
        self.store = store

    def create(self, user: str, created_by: str, note: str = "") -> tuple[str, dict[str, Any]]:
        """A new token for `user` (must exist on this machine); returns (token, its public record)."""
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            raise ValueError(f"no user {user!r} on this machine") from None
        token_id, secret = secrets.token_hex(TOKEN_ID_HEX_DIGITS // 2), secrets.token_urlsafe(32)
        self.store.add_token(token_id, user, uid, _digest(secret), time.time(), created_by, note)
        return f"{PREFIX}_{token_id}_{secret}", public(self.store.tokens(token_id)[0])

    def verify(self, token: str) -> Optional[TokenOwner]:
        m = _TOKEN.match(token.strip())
        if not m:
            return None
        rows = self.store.tokens(m.group(1))
        # Compare even when the id is unknown, so timing does not tell ids apart.
        stored = rows[0]["hash"] if rows else _digest("")
        if not hmac.compare_digest(stored, _digest(m.group(2))) or not rows:
            return None
        uid, user = int(rows[0]["uid"]), str(rows[0]["user"])
        # The account it was made for must still be the one with its uid: once that account is
        # deleted, the token acted as nobody's uid, and then as whoever was given the uid next.
        try:
            if pwd.getpwuid(uid).pw_name != user:
                return None
        except KeyError:
            return None
        return TokenOwner(uid=uid, user=user)

    def list(self, uid: Optional[int] = None) -> list[dict[str, Any]]:
        """Every token, or those that act as `uid` (by uid: a new account under an old name is
        not the old account)."""
        return [public(r) for r in self.store.tokens() if uid is None or int(r["uid"]) == uid]

    def revoke(self, token_id: str) -> bool:
        return self.store.delete_token(token_id)


def public(row: dict[str, Any]) -> dict[str, Any]:
    """A token's record without its digest."""
    return {k: row[k] for k in ("id", "user", "uid", "created", "created_by", "note")}
