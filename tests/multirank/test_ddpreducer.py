"""DDP's Reducer across a multi-rank RAM park (runtime/ddpreducer.py), one gloo process driving a
real rank handle through park, unpark and regroup on a simulated GPU (ddpreducer_job.py): the
Reducer's bucket buffers are freed while parked (a communication hook's weak references to them
expire, the simulated GPU keeps only the context floor) and made again at unpark with the same
buckets; the run then goes on bitwise as without the park, with the Python or built-in hook
registered again (FP16_COMPRESS rounds: had it been lost, the result would differ), unused
parameters found, and a hook on a parameter's AccumulateGrad node still called. Where the
Reducer is kept (static_graph, gradient_as_bucket_view=True) the park says why and the simulated
GPU counts what stays."""
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

from gpuswap.protocol.env import SIM_CUDA_DIR  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
FLOOR = 1_000_000
FREED = ("plain", "hook", "find_unused", "builtin_hook")
KEPT = {"static_graph": "static_graph=True", "grad_views": "gradient_as_bucket_view=True"}


def test_ddp_bucket_buffers_are_freed_while_parked_and_the_run_goes_on_bitwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=f"{SRC}{os.pathsep}{env.get('PYTHONPATH', '')}", CUDA_VISIBLE_DEVICES="0",
               GPUSWAP_SIM_CONTEXT_BYTES=str(FLOOR))
    env[SIM_CUDA_DIR] = str(tmp_path / "sim")
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("ddpreducer_job.py")), *FREED, *KEPT],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for case, seen in out.items():
        assert seen["bitwise"] and seen["layout_kept"] and seen["new_group"], (case, seen)
        assert seen["node_hook_calls_after"] == 3, (case, seen)        # one per backward after the resume
        assert seen["unparked"] == seen["running"], (case, seen)       # all of it back at unpark
    for case in FREED:
        seen = out[case]
        assert seen["reducer_dropped"] and seen["kept"] == [], (case, seen)
        assert seen["parked"] == FLOOR, (case, seen)                   # nothing but the context floor
        assert seen["running"] == FLOOR + seen["attached"] + seen["params"], (case, seen)
    assert out["hook"]["freed"] and out["find_unused"]["freed"]      # the storages themselves are gone
    assert out["hook"]["hook_ran_after"] and out["hook"]["hook_name"] == "probe_hook"
    assert out["builtin_hook"]["hook_name"] == "BuiltinCommHookType.FP16_COMPRESS"
    for case, why in KEPT.items():
        seen = out[case]
        assert not seen["reducer_dropped"] and len(seen["kept"]) == 1 and why in seen["kept"][0], (case, seen)
    # static_graph: its buffers stay and the simulated GPU says so; with gradient_as_bucket_view
    # the buffers are the gradients (attached bytes): parked with them.
    assert out["static_graph"]["parked"] == FLOOR + out["static_graph"]["params"]
    assert out["grad_views"]["parked"] == FLOOR
    assert out["grad_views"]["running"] == FLOOR + out["grad_views"]["attached"]
