"""Multi-process framework runs under a real daemon: the job is paused to RAM twice (each time
every rank waits at a step until the supervisor's pause reached it, then parks at the callback's
own safepoint), resumed, and its per-rank results are compared with the same command run outside
gpuswap (started at once, so the two run side by side)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from fw_runner import HERE, SRC
from gpuswap_testing import reference_env

HOLDS = "2,7"  # optimizer steps (0-based) at which the daemon pauses the job


def _env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=os.pathsep.join([str(HERE), SRC]), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def start_reference(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=_env(reference_env(simulated=True)), cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def results(out: Path, world: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def park_twice(d: Any, argv: list[str], home: Path) -> dict[str, Any]:
    """Submit `argv` as a 2-rank job, pause it to RAM and resume it twice, let it complete."""
    env = _env(d.env)
    env["FW_HOLD_AT"] = HOLDS
    job = d.submit(argv, name="fw-ranks", gpus=2, env=env)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    for n in (1, 2):
        assert d.cli("pause", str(job), "--to", "ram").returncode == 0
        j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
                    and len(j["ranks"]) == 2 and all(r["state"] == "parked" for r in j["ranks"]))
        assert j["parked_bytes"] > 0, json.dumps(j, indent=1)
        assert d.cli("resume", str(job)).returncode == 0
        # After the last park nothing holds the job: it may train to its end before the daemon's
        # next look, so its resume shows as RUNNING or as the job's end ("... while resuming").
        d.until(job, lambda j: (j["state"] == "RUNNING"
                                and sum(e["reason"].startswith("resumed from RAM") for e in j["events"]) == n)
                or (n == 2 and j["state"] in ("COMPLETED", "FAILED")))
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", json.dumps(done["events"], indent=1) + (home / "daemon.out").read_text()[-3000:]
    assert sum(e["reason"].startswith("parked in RAM") for e in done["events"]) == 2
    return done


def finish_reference(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
