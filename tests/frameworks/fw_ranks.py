"""Multi-process framework runs under a real daemon: the job is paused to RAM, resumed, then
paused to disk (each time every rank waits at a step until the supervisor's pause reached it,
then parks at the callback's own safepoint), requeued, restarted (every rank's callback feeds
its framework the checkpoint's state), and its per-rank results are compared with the same
command run outside gpuswap (started at once, so the two run side by side)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from fw_runner import HERE, SRC
from gpuswap_testing import reference_env


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


def _events(j: dict[str, Any], start: str) -> int:
    return sum(e["reason"].startswith(start) for e in j["events"])


def park_ram_then_disk(d: Any, argv: list[str], home: Path, ram_at: int, disk_at: int) -> dict[str, Any]:
    """Submit `argv` as a 2-rank job; pause it to RAM at optimizer step `ram_at` and resume it;
    pause it to disk at `disk_at` and resume it (a restart from the checkpoint); let it complete."""
    env = _env(d.env)
    env["FW_HOLD_AT"] = f"{ram_at},{disk_at}"
    job = d.submit(argv, name="fw-ranks", gpus=2, env=env)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
                and len(j["ranks"]) == 2 and all(r["state"] == "parked" for r in j["ranks"]))
    assert j["parked_bytes"] > 0 and j["step"] == ram_at, json.dumps(j, indent=1)
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "resumed from RAM") == 1)
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert j["step"] == disk_at and "PAUSED (parked on disk, 2 ranks," in d.cli("ls").stdout
    assert d.cli("resume", str(job)).returncode == 0
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", json.dumps(done["events"], indent=1) + (home / "daemon.out").read_text()[-3000:]
    assert _events(done, "parked in RAM") == 1 and _events(done, "parked to disk") == 1
    assert _events(done, "restarted from its disk checkpoint") == 1, json.dumps(done["events"], indent=1)
    return done


def finish_reference(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
