"""`gpuswap token ...` and `gpuswap dashboard-url`: bearer tokens for the daemon's TCP listener.

Tokens are created over the Unix socket (the kernel says who you are); the printed secret is shown
once and stored only hashed. Use it as GPUSWAP_URL/GPUSWAP_TOKEN for the CLI, or open the printed
dashboard URL (the token rides in the URL fragment, which browsers never send to the server).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from gpuswap.api.sizes import TOKEN_ID_HEX_DIGITS
from gpuswap.printable import printable


def register(sub: Any, client: Callable[[], Any], out: Callable[..., None]) -> None:
    json_flag: dict[str, Any] = dict(action="store_true", help="print the record(s) as JSON")
    t = sub.add_parser("token", help="bearer tokens for remote access (gpuswap server --listen)")
    tsub = t.add_subparsers(dest="token_verb", required=True, parser_class=type(t))
    c = tsub.add_parser("create", help="create a token for yourself (admins: --user NAME)")
    c.add_argument("--user", help="the user the token acts as (admins only)")
    c.add_argument("--note", default="", help="what the token is for, e.g. 'laptop' or 'prometheus'")
    c.add_argument("--json", **json_flag)
    c.set_defaults(func=lambda a: _create(a, client, out, dashboard=False))
    ls = tsub.add_parser("ls", help="list tokens (yours; admins: all)")
    ls.add_argument("--json", **json_flag)
    ls.set_defaults(func=lambda a: _list(a, client, out))
    rv = tsub.add_parser("revoke", help="revoke a token by its id")
    rv.add_argument("id", type=token_id, help="the token's id (`gpuswap token ls` shows it)")
    rv.add_argument("--json", **json_flag)
    rv.set_defaults(func=lambda a: (out(a, client().delete(f"/v1/tokens/{a.id}"),
                                        lambda r: print(f"revoked token {r['revoked']}")), 0)[1])

    tsub.metavar = "{" + ",".join(tsub.choices) + "}"   # "required: {create,ls,revoke}", not "token_verb"

    d = sub.add_parser("dashboard-url", help="create a token and print the web dashboard's URL with it")
    d.add_argument("--user", help="the user the token acts as (admins only)")
    d.add_argument("--note", default="dashboard", help="what the token is for")
    d.add_argument("--json", **json_flag)
    d.set_defaults(func=lambda a: _create(a, client, out, dashboard=True))


def token_id(text: str) -> str:
    """A token's id as `token ls` shows it (hex digits): anything else is a usage error, never a
    piece of the request's path ("a/b", "?x" and "" reached other routes)."""
    if len(text) != TOKEN_ID_HEX_DIGITS or any(c not in "0123456789abcdef" for c in text):
        raise argparse.ArgumentTypeError(f"'{printable(text)}' is not a token id "
                                         f"({TOKEN_ID_HEX_DIGITS} hex digits, as `gpuswap token ls` shows)")
    return text


def _create(a: argparse.Namespace, client: Callable[[], Any], out: Callable[..., None], dashboard: bool) -> int:
    # For a dashboard URL the daemon refuses (409, exit 1) before making a token it has no URL for.
    body = {"user": a.user, "note": a.note, **({"for_dashboard": True} if dashboard else {})}
    rec = client().post("/v1/tokens", body)

    def human(r: dict[str, Any]) -> None:
        if dashboard:
            print(r["dashboard_url"] or "the daemon has no TCP listener; start it with "
                                        "`gpuswap server --listen HOST:PORT`")
            return
        print(f"token {r['id']} for {r['user']} (shown once; only its hash is stored):\n{r['token']}")
        if r.get("url"):
            print(f"\nuse it:  export GPUSWAP_URL={r['url']} GPUSWAP_TOKEN={r['token']}")
            print(f"browser: {r['dashboard_url']}")
        else:
            print("\nthe daemon has no TCP listener yet: start it with `gpuswap server --listen HOST:PORT`")

    out(a, rec, human)
    return 0 if rec.get("dashboard_url") or not dashboard else 1


def _list(a: argparse.Namespace, client: Callable[[], Any], out: Callable[..., None]) -> int:
    from gpuswap.terminal import console, plain
    from rich.table import Table

    def human(rows: list[dict[str, Any]]) -> None:
        if not rows:
            console.print("no tokens")
            return
        tab = Table(box=None, pad_edge=False)
        for col in ("ID", "USER", "CREATED", "BY", "NOTE"):
            tab.add_column(col)
        for r in rows:
            # A note is the user's text: as a Text, never markup ("[/]" crashed the table), escaped.
            tab.add_row(plain(r["id"]), plain(r["user"]),
                        time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"])), plain(r["created_by"]),
                        plain(r["note"]))
        console.print(tab)

    out(a, client().get("/v1/tokens"), human)
    return 0
