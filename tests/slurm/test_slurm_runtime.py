"""The Slurm side of the runtime and `gpuswap slurm-wrap`, without Slurm daemons: a fake Slurm
environment, real processes, real signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuswap.jobs import REQUEUE_EXIT_CODE
from gpuswap.runtime import slurm

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_detection_and_default_checkpoint_dir(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "2"}
    cfg = slurm.config_from_env(env)
    assert cfg is not None and cfg.slurm and cfg.job_id == "42" and cfg.control is None
    assert cfg.ckpt_dir == str(tmp_path / ".gpuswap" / "ckpt" / "42")
    assert slurm.restart_count(env) == 2
    assert slurm.config_from_env({**env, "GPUSWAP_CKPT_DIR": "/x"}).ckpt_dir == "/x"
    assert slurm.config_from_env({**env, "GPUSWAP_SLURM": "0"}) is None
    assert slurm.config_from_env({}) is None


def test_signal_spec_parsing() -> None:
    assert slurm.parse_signals(slurm.DEFAULT_SIGNALS) == [signal.SIGUSR2, signal.SIGTERM]
    assert signal.SIGUSR1 not in slurm.parse_signals(slurm.DEFAULT_SIGNALS)  # NCCL's
    assert slurm.parse_signals("SIGUSR1 15") == [signal.SIGUSR1, signal.SIGTERM]
    assert slurm.parse_signals("none") == []
    for bad in ("FOO", "KILL"):
        with pytest.raises(ValueError):
            slurm.parse_signals(bad)


def _demo(tmp: Path, *, wrap: bool, steps: int = 400) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "gpuswap.demo.train", "--steps", str(steps), "--step-time", "0.01",
           "--log-every", "1", "--out", str(tmp / "result.json")]
    if wrap:
        cmd = [sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", "--", *cmd]
    return subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_training(p: subprocess.Popen) -> None:
    assert p.stdout is not None
    for line in p.stdout:  # attach() has installed the handlers once training prints
        if line.startswith("train: step 5/"):
            return
    raise AssertionError(p.stderr.read() if p.stderr else "no output")


@pytest.mark.parametrize("wrap", [False, True], ids=["direct", "slurm-wrap"])
def test_signal_checkpoints_at_safepoint_and_exits_75(tmp_path: Path, wrap: bool) -> None:
    p = _demo(tmp_path, wrap=wrap)
    _wait_training(p)
    p.send_signal(signal.SIGUSR2)
    _, err = p.communicate(timeout=180)
    assert p.returncode == REQUEUE_EXIT_CODE, err
    assert "got SIGUSR2 from Slurm" in err
    if wrap:
        assert "slurm-wrap: forwarding SIGUSR2" in err
    manifests = sorted((tmp_path / ".gpuswap" / "ckpt" / "7").glob("ckpt-*.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["job_id"] == "7"


def test_slurm_wrap_exit_codes(tmp_path: Path) -> None:
    def wrap(*args: str) -> int:
        return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", *args],
                              capture_output=True, timeout=60).returncode

    assert wrap("--", "sh", "-c", "exit 3") == 3
    assert wrap("--", "sh", "-c", "kill -KILL $$") == 128 + signal.SIGKILL  # like bash: 137
    assert wrap() == 64 and wrap("--signals", "BOGUS", "--", "true") == 64
    assert wrap("--", str(tmp_path / "missing")) == 127


def test_slurm_wrap_forwards_to_a_child_without_gpuswap(tmp_path: Path) -> None:
    """A child that never imports gpuswap simply gets the signal: SIGTERM kills it, the
    wrapper reports 143 as a shell would."""
    p = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "slurm-wrap", "--",
                          "sh", "-c", "echo ready; exec sleep 600"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"  # handlers are in place
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 128 + signal.SIGTERM, err     # killed by the signal (a finished sleep exits 0)


REATTACH = """
import os, signal, sys, time
import torch
import gpuswap

model = torch.nn.Linear(2, 2)
job = gpuswap.attach(model=model)
for step in range(3):
    job.safepoint(step)
for sig in (signal.SIGUSR2, signal.SIGTERM):   # what a framework's signal teardown does
    signal.signal(sig, signal.SIG_DFL)
job = gpuswap.attach(model=model)              # e.g. a second Lightning fit
for step in range(500):
    if step == 5:
        os.kill(os.getpid(), signal.SIGUSR2)
    job.safepoint(step)
    time.sleep(0.01)
sys.exit(3)
"""


def test_a_second_attach_takes_back_replaced_signal_handlers(tmp_path: Path) -> None:
    """Handlers put back by someone else after the first attach are ours again after the next
    one: the signal becomes a checkpoint and exit 75, not death by SIGUSR2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSWAP_", "SLURM_"))}
    env.update(SLURM_JOB_ID="8", SLURM_SUBMIT_DIR=str(tmp_path), GPUSWAP_SLURM_REQUEUE="exit",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", REATTACH], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == REQUEUE_EXIT_CODE, (p.returncode, p.stderr)
    assert p.stderr.count("got SIGUSR2 from Slurm") == 1
    manifests = sorted((tmp_path / ".gpuswap" / "ckpt" / "8").glob("ckpt-*.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["step"] >= 5
