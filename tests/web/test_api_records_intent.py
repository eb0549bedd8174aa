"""The API only records a user's intent (docs/architecture.md): every job write in api/ sets only
the columns that say what a user asked for. What the job's supervisor is asked (`desired`,
`desired_tier`, `pause_requested_at`) and every state change are the controller's, made level-
triggered from that intent (node/moves.py's `Moves.user_intent`)."""
from __future__ import annotations

import ast
from pathlib import Path

import gpuswap.api

INTENT = {"hold", "hold_tier", "cancel_requested"}     # the user's columns of `jobs`


def _job_writes() -> list[tuple[str, int, set[str]]]:
    out = []
    for path in sorted(Path(gpuswap.api.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "store"):
                assert all(k.arg is not None for k in node.keywords), f"{path.name}:{node.lineno}: **changes"
                out.append((path.name, node.lineno, {k.arg for k in node.keywords} - {"event", "initiator"}))
    return out


def test_the_api_writes_only_what_the_user_asked_for():
    writes = _job_writes()
    assert len(writes) >= 3                                  # cancel, pause, resume
    assert [(name, line, cols - INTENT) for name, line, cols in writes if cols - INTENT] == []
