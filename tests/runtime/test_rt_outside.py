"""Outside gpuswap the runtime costs nothing and changes nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import gpuswap
from gpuswap.runtime import NullJob


def test_attach_outside_gpuswap_is_a_noop(monkeypatch):
    monkeypatch.delenv("GPUSWAP_JOB_ID", raising=False)
    job = gpuswap.attach({"lr": 0.1}, [1, 2], epoch=3, tag="a")
    assert isinstance(job, NullJob)
    assert job.start_step == 0 and not job.parked and not job.inside
    assert job.state == {"epoch": 3, "tag": "a"}       # plain values, as inside before a checkpoint
    job.state["x"] = 1
    for step in range(3):
        job.safepoint(step)
    assert job.step == 2


def test_import_and_noop_attach_never_import_heavy_modules():
    code = ("import sys, gpuswap; j = gpuswap.attach(); j.safepoint(0); "
            "print(sorted(m for m in ('torch', 'numpy', 'fastapi', 'uvicorn') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def _attach_both_ways(monkeypatch, **objects):
    """attach() outside gpuswap, then inside (a job id, no supervisor, no checkpoint dir)."""
    out = []
    for inside in (False, True):
        if inside:
            monkeypatch.setenv("GPUSWAP_JOB_ID", "x")
        else:
            monkeypatch.delenv("GPUSWAP_JOB_ID", raising=False)
        for k in ("GPUSWAP_CONTROL", "GPUSWAP_CKPT_DIR", "SLURM_JOB_ID"):
            monkeypatch.delenv(k, raising=False)
        try:
            job = gpuswap.attach(**objects)
            out.append(("ok", job.inside, dict(job.state)))
            job.close()
        except TypeError as e:
            out.append(("TypeError", inside, str(e)))
    return out


def test_plain_values_land_in_job_state_the_same_inside_and_outside(monkeypatch):
    (o, i) = _attach_both_ways(monkeypatch, epoch=3, seed=None, shape=(2, 3), name="run")
    assert o == ("ok", False, {"epoch": 3, "seed": None, "shape": (2, 3), "name": "run"})
    assert i == ("ok", True, o[2])


def test_unrestorable_values_are_refused_the_same_inside_and_outside(monkeypatch):
    (o, i) = _attach_both_ways(monkeypatch, epoch=3, thing=object())
    assert o[0] == i[0] == "TypeError" and o[2] == i[2]
    assert "thing='object'" in o[2] and "job.state" in o[2]
