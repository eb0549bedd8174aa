"""What the supervisor tells a job through its environment: the runtime's configuration.

Its own module, below the handle, the park path and the Slurm support, so that each of them can
name the configuration without importing another (they used to import each other through it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from gpuswap.protocol.env import JobEnv


@dataclass(frozen=True)
class RuntimeConfig:
    """What the supervisor tells the job through its environment."""

    job_id: str | None
    control: str | None
    ckpt_dir: str | None
    simulated: bool
    slurm: bool = False  # standalone under Slurm: signals -> disk pause, then requeue

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RuntimeConfig":
        given = JobEnv.from_env(env)
        return cls(job_id=given.job_id, control=given.control, ckpt_dir=given.ckpt_dir, simulated=given.simulated)
