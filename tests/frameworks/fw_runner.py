"""Framework tests run small real jobs as subprocesses (a disk park exits the process with 75)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest


HERE = Path(__file__).parent
SRC = str(HERE.parents[1] / "src")


def require(extra: str, *packages: str) -> None:
    """Skip the calling test module where a package of gpuswap[extra] is not installed. Looks for
    it without importing it (pytest.importorskip would): each xdist worker collects every module,
    and importing Lightning or transformers there cost ~5 s of CPU a worker; the jobs import them."""
    for name in packages:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed: pip install 'gpuswap[{extra}]'", allow_module_level=True)


def _start(script: str, out: Path, ckpt: Optional[Path], pauses: str,
           extra_env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(extra_env or {})
    env.update(PYTHONPATH=os.pathsep.join([str(HERE), SRC]), FW_PAUSES=pauses,
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if ckpt is not None:
        env.update(GPUSWAP_JOB_ID="fw-test", GPUSWAP_CKPT_DIR=str(ckpt))
        if env.get("FW_ACCEL") != "gpu":     # CPU tensors stand for device memory
            env.update(GPUSWAP_SIMULATED_GPU="1")
    return subprocess.Popen([sys.executable, str(HERE / script), str(out)], env=env, cwd=out.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, out: Path, expect_rc: int) -> Optional[dict[str, Any]]:
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == expect_rc, f"rc {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return json.loads(out.read_text()) if expect_rc == 0 else None


def run_all(script: str, tmp: Path, plans: list[str],
            env: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """The uninterrupted run (outside gpuswap) and one run per pause plan (FW_PAUSES, e.g.
    "ram:10,disk:16") inside it, as concurrent processes. A plan ending in a disk park must exit
    75 leaving a committed checkpoint; its result is then the restarted process's. `env`: more
    environment for every run (the job script's own switches)."""
    first = {"baseline": (_start(script, tmp / "baseline.json", None, "", env), tmp / "baseline.json", 0)}
    for plan in plans:
        first[plan] = (_start(script, tmp / f"{plan}.json", tmp / f"ckpt-{plan}", plan, env),
                       tmp / f"{plan}.json", 75 if "disk" in plan or "spill" in plan else 0)
    results = {name: _finish(p, out, rc) for name, (p, out, rc) in first.items()}
    second = {}
    for plan in plans:
        if "disk" in plan or "spill" in plan:
            assert list((tmp / f"ckpt-{plan}").glob("ckpt-*.json")), "the disk park left no checkpoint"
            second[plan] = _start(script, tmp / f"{plan}.json", tmp / f"ckpt-{plan}", plan, env)
    for plan, p in second.items():
        results[plan] = _finish(p, tmp / f"{plan}.json", 0)
    return results  # type: ignore[return-value]


def check_mixed_precision_on_gpu(script: str, tmp: Path, pauses: dict[str, int]) -> None:
    """The job on CUDA in 16-bit mixed precision (`FW_ACCEL=gpu`): every pause plan (plan -> the
    step its disk park was at) ends with the uninterrupted run's parameters bitwise, its loss scale
    (the GradScaler's, a CUDA tensor) and learning rate; the first plan's RAM park freed memory.
    A spill plan exits 75 like a disk park: the unwinding after it found its tensors whole."""
    r = run_all(script, tmp, list(pauses), env={"FW_ACCEL": "gpu"})
    base = r["baseline"]
    assert base["global_step"] == 36 and base["scale"] is not None
    for plan, at in pauses.items():
        assert r[plan]["restored_step"] == at
        assert (r[plan]["sha256"], r[plan]["scale"], r[plan]["lr"]) == (base["sha256"], base["scale"], base["lr"]), plan
    first = r[next(iter(pauses))]
    assert first["parked_bytes"] and first["parked_bytes"][0] > 0
