"""The everyday verbs load only what they use: every CLI call is a new interpreter, and the heavy
modules (the daemon's web stack, rich, the policy, the runtime, torch) were most of its CPU time."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("httpx", "fastapi", "pydantic", "uvicorn", "starlette", "rich", "torch", "numpy", "psutil",
         "gpuswap.policy", "gpuswap.node", "gpuswap.runtime", "gpuswap.sim")

CALLS = """
import json, sys
from gpuswap.cli.main import main
codes = [main(argv) for argv in json.loads(sys.argv[1])]
print(json.dumps({"codes": codes, "modules": sorted(sys.modules)}), file=sys.stderr)
"""


def test_everyday_verbs_import_no_heavy_module(daemon):
    argvs = [["submit", "--json", "--", "true"], ["submit", "--json", "--", "sleep", "600"], ["wait", "1"],
             ["ls", "--json"], ["show", "1", "--json"], ["gpus", "--json"], ["cancel", "2", "--json"]]
    r = subprocess.run([sys.executable, "-c", CALLS, json.dumps(argvs)], env=daemon.env,
                       capture_output=True, text=True, timeout=120)
    found = json.loads(r.stderr.splitlines()[-1])
    assert found["codes"] == [0] * len(argvs), r.stderr      # the calls did their work
    assert '"state": "CANCELLED"' in r.stdout and '"name": "true"' in r.stdout, r.stdout
    loaded = [m for m in found["modules"] if m.split(".")[0] in HEAVY or m.startswith(HEAVY)]
    assert not loaded, loaded


def test_a_table_still_renders_with_rich(daemon):
    """The human output imports rich when it needs it (cli/render.py)."""
    r = daemon.cli("ls")
    assert r.returncode == 0 and "no jobs" in r.stdout, r
