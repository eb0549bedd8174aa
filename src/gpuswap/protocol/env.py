"""Every environment variable gpuswap reads or sets, by name (`gpuswap --help` documents them:
cli/helptext.py, whose test checks that each name here is listed there or marked internal).

Cheap to import: the runtime reads these in the job at `attach`, and the CLI at each call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# -- set by the daemon for each job (node/launcher.py), read by the runtime in it --------------------
JOB_ID = "GPUSWAP_JOB_ID"
CONTROL = "GPUSWAP_CONTROL"            # the control socket's path (protocol/channel.py)
CKPT_DIR = "GPUSWAP_CKPT_DIR"          # where the job's disk checkpoints live
SIMULATED = "GPUSWAP_SIMULATED_GPU"    # "1": no real GPU; attached CPU tensors stand for device memory
SIM_CUDA_DIR = "GPUSWAP_SIM_CUDA_DIR"  # simulated GPUs only: the simulated driver's directory (simcuda.py)

# -- read by the runtime in the job: the user's settings -----------------------------------------------
RESTART_ON_BAD_CHECKPOINT = "GPUSWAP_RESTART_ON_BAD_CHECKPOINT"  # "1": no usable checkpoint -> step 0
ADOPT_CHECKPOINTS = "GPUSWAP_ADOPT_CHECKPOINTS"  # a job id: resume from that job's checkpoints (checkpoint.py)
PINNED_KEEP_S = "GPUSWAP_PINNED_KEEP_S"          # seconds an idle pinned host buffer is kept
PREFAULT = "GPUSWAP_PREFAULT"                    # "0": no host buffers prepared when a pause is asked
USAGE_INTERVAL_S = "GPUSWAP_USAGE_INTERVAL_S"    # seconds between usage reports (tests shorten it)
SIM_CONTEXT_BYTES = "GPUSWAP_SIM_CONTEXT_BYTES"  # a simulated CUDA context's size (simcuda.py)
SIM_DEVICES = "GPUSWAP_SIM_DEVICES"  # simulated GPUs: the device ordinals a job's tensors live on (runtime/simdevice.py)
SLURM = "GPUSWAP_SLURM"                          # "0" keeps the runtime off under Slurm
SLURM_SIGNALS = "GPUSWAP_SLURM_SIGNALS"          # e.g. "USR2,TERM" (default), "USR1", "none"
SLURM_REQUEUE = "GPUSWAP_SLURM_REQUEUE"          # "scontrol" (default) | "exit"
SLURM_PAUSE_TIMEOUT_S = "GPUSWAP_SLURM_PAUSE_TIMEOUT_S"  # a phase of the ranks' agreement that takes longer ends it

# -- read by the CLI, the daemon and the commands that start a private daemon ------------------------
HOME = "GPUSWAP_HOME"        # the daemon's state directory (socket, database, job directories)
CONFIG = "GPUSWAP_CONFIG"    # `gpuswap server`'s config file (node/settings.py)
URL = "GPUSWAP_URL"          # a daemon reached over TCP (api/client.py)
TOKEN = "GPUSWAP_TOKEN"      # its bearer token
SELFTEST_WRONG_REFERENCE = "GPUSWAP_SELFTEST_WRONG_REFERENCE"   # tests: selftest compares to a wrong reference
# A pool node's agent (docs/ray.md), set in the environment of that node's `ray start`:
AGENT_HOME = "GPUSWAP_AGENT_HOME"            # its state directory (default /var/lib/gpuswap/node)
AGENT_SIMULATE_GPUS = "GPUSWAP_AGENT_SIMULATE_GPUS"   # simulated GPUs on it, as --simulate-gpus
NODE_NAME = "GPUSWAP_NODE_NAME"              # its name in the pool (default: its host name)
AGENT_SHARED_CKPT = "GPUSWAP_AGENT_SHARED_CKPT"  # a directory every node mounts: disk checkpoints there


def _flag(value: Optional[str]) -> bool:
    return (value or "") not in ("", "0")


@dataclass(frozen=True)
class JobEnv:
    """What the daemon tells a job through its environment (besides CUDA_VISIBLE_DEVICES): written
    by the launcher (`to_env`), read back by the runtime (`from_env`; absent or empty is None)."""

    job_id: Optional[str] = None
    control: Optional[str] = None
    ckpt_dir: Optional[str] = None
    simulated: bool = False
    sim_cuda_dir: Optional[str] = None

    def to_env(self) -> dict[str, str]:
        out = {name: value for name, value in ((JOB_ID, self.job_id), (CONTROL, self.control),
                                              (CKPT_DIR, self.ckpt_dir)) if value is not None}
        if self.simulated:
            out[SIMULATED] = "1"
        if self.sim_cuda_dir is not None:
            out[SIM_CUDA_DIR] = self.sim_cuda_dir
        return out

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "JobEnv":
        return cls(job_id=env.get(JOB_ID) or None, control=env.get(CONTROL) or None,
                   ckpt_dir=env.get(CKPT_DIR) or None, simulated=_flag(env.get(SIMULATED)),
                   sim_cuda_dir=env.get(SIM_CUDA_DIR) or None)
