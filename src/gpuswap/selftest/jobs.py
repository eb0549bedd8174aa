"""The selftest's bundled jobs: their commands, sizes and environments.

The cooperative job is the demo training script (an MLP with AdamW, a scheduler, a batch
generator, dropout) held at a step by `coop_job`; its attached state is parameters, gradients and
AdamW's two moments, 16 bytes per parameter, nearly all in the hidden layer (hidden² weights), so
`--size` picks the hidden width. The unmodified job (`plain_job.py`) allocates exactly `--size` bytes
(NVML lists its process with its CUDA context too).
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpuswap.demo.train import N_FEATURES
from gpuswap.protocol import env as envvars

BYTES_PER_PARAM = 16          # float32 parameter + gradient + AdamW exp_avg + exp_avg_sq
STEPS, HOLD_AT = 24, 10       # held at step 10; a job restored from a checkpoint there still has steps to run
PROBE_HIDDEN, PROBE_STEPS, PROBE_HOLD_AT = 8, 3, 1
SEED = 1234
PLAIN_JOB = Path(__file__).with_name("plain_job.py")


def hidden_for(size_bytes: int) -> int:
    """The demo model's hidden width whose attached state is closest to `size_bytes` from below."""
    return max(PROBE_HIDDEN, math.isqrt(max(0, size_bytes) // BYTES_PER_PARAM))


def coop_state_bytes(hidden: int) -> int:
    """Attached bytes of the demo model at this width (Linear(16,h), Linear(h,h), Linear(h,1))."""
    params = (N_FEATURES * hidden + hidden) + (hidden * hidden + hidden) + (hidden + 1)
    return BYTES_PER_PARAM * params


@dataclass(frozen=True)
class Files:
    """A scenario's files in its own directory: the job's gate, its marker, its result."""

    dir: Path

    @property
    def gate(self) -> Path:
        return self.dir / "gate"

    @property
    def marker(self) -> Path:
        return self.dir / "held.json"

    @property
    def out(self) -> Path:
        return self.dir / "result.json"

    def make(self) -> "Files":
        self.dir.mkdir(parents=True, exist_ok=True)
        return self


def coop_argv(files: Files, hidden: int, steps: int = STEPS, hold_at: int = HOLD_AT,
              seed: int = SEED) -> list[str]:
    return [sys.executable, "-m", "gpuswap.selftest.coop_job", "--gate", str(files.gate),
            "--marker", str(files.marker), "--hold-at", str(hold_at), "--",
            "--steps", str(steps), "--hidden", str(hidden), "--seed", str(seed), "--out", str(files.out),
            "--log-every", str(steps)]


def plain_argv(files: Files, nbytes: int, steps: int = STEPS, hold_at: int = HOLD_AT,
               seed: int = SEED) -> list[str]:
    return [sys.executable, str(PLAIN_JOB), "--bytes", str(nbytes), "--steps", str(steps),
            "--hold-at", str(hold_at), "--gate", str(files.gate), "--marker", str(files.marker),
            "--out", str(files.out), "--seed", str(seed)]


def under_shell(argv: list[str]) -> list[str]:
    """`sh -c 'CMD; exit $?'`: the trailing command keeps sh from exec'ing CMD, so CMD runs as the
    shell's child, as a job script's python does; sh exits with CMD's code."""
    return ["sh", "-c", f"{shlex.join(argv)}; exit $?"]


def blocker_argv(gate: Path) -> list[str]:
    """A placeholder job that uses no GPU: it holds one GPU in the private daemon's books (so the
    next job is placed on the GPU under test) until its gate exists."""
    return ["sh", "-c", 'i=0; while [ ! -e "$1" ] && [ $i -lt 36000 ]; do sleep 0.1; i=$((i+1)); done',
            "blocker", str(gate)]


def job_env() -> dict[str, str]:
    """The selftest's environment without gpuswap's variables: the private daemon sets its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUSWAP_")}


def reference_env(simulated: bool, gpu_uuid: Optional[str]) -> dict[str, str]:
    """Outside gpuswap, on the same kind of device as the job: the GPU under test (by UUID, as the
    daemon names it to its jobs), or the CPU that stands in for a simulated GPU."""
    env = job_env()
    if simulated:
        env[envvars.SIMULATED] = "1"     # the demo script and the plain job then use the CPU
    elif gpu_uuid:
        env.update(CUDA_VISIBLE_DEVICES=gpu_uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    return env


def read_result(path: Path) -> dict[str, Any]:
    """A job's JSON file (its result, or its marker), {} while it is absent or not a JSON object
    (the jobs write them atomically, so a half-written one is never seen)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}
