"""DDP communication hooks across a regroup (runtime/regroup.py): torch documents that
`_update_process_group` leaves hooks' groups to the caller. A hook state's `process_group` (torch's
PowerSGDState, PostLocalSGDState) is pointed at the new group; a hook whose state *is* the group (kept by
the reducer's C++ hook) is a ram_refusal; a state of None needs nothing; a built-in hook (which keeps
its group in C++) is a ram_refusal only where a park keeps the Reducer. One gloo process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

SRC = Path(__file__).resolve().parents[2] / "src"


def test_ddp_comm_hook_groups_are_rebound_or_refused():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}"
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("regroup_hooks_job.py"))], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["powersgd_refusal"] is None and out["powersgd_rebound"] is True
    assert out["odd_state_refusal"] and "communication hook" in out["odd_state_refusal"]
    assert out["none_state_refusal"] is None
    assert out["group_state_refusal"] and "communication hook" in out["group_state_refusal"]
    assert out["builtin_refusal"] is None
    assert out["builtin_static_refusal"] and "built-in DDP communication hook" in out["builtin_static_refusal"]
