"""The usage heartbeat must never touch the job's tensors from its own thread (issue 10 item 1).

Reading `.grad` or `untyped_storage()` of attached tensors from the heartbeat thread while the
training thread ran `zero_grad`/`backward`/`step` crashed the job with SIGSEGV. Here the
heartbeat runs every millisecond (`$GPUSWAP_USAGE_INTERVAL_S`) while the demo trains a 2.3M
parameter MLP (hidden width 1500): the old runtime died with SIGSEGV within its first ~15 steps
on every run measured; now the job must finish and still report its device memory.
"""
from __future__ import annotations

import signal
import subprocess
import sys

from gpuswap_rt_peer import finish, job_env, read_result

from gpuswap.runtime import client

HIDDEN, STEPS = 1500, 40


def test_millisecond_heartbeat_during_training_does_not_crash(peer, tmp_path):
    out = tmp_path / "result.json"
    env = dict(job_env(peer, None), GPUSWAP_USAGE_INTERVAL_S="0.001")
    proc = subprocess.Popen([sys.executable, "-m", "gpuswap.demo.train", "--steps", str(STEPS),
                             "--hidden", str(HIDDEN), "--out", str(out), "--log-every", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rc, stdout, err = finish(proc, timeout=300)
    assert rc != -signal.SIGSEGV, f"the job crashed with SIGSEGV after:\n{stdout[-300:]}{err}"
    assert rc == 0, err
    assert read_result(out)["steps"] == STEPS
    usage = [m for m in peer.log if m["op"] == "usage"]
    hello = next(m for m in peer.log if m["op"] == "hello")
    assert hello["device_bytes"] > 0  # measured at attach, in the training thread
    # Measured at safepoints: reports grow past the attach-time figure once optimizer state
    # exists, and carry the step.
    assert max(m["device_bytes"] for m in usage) > hello["device_bytes"]
    assert any(m["step"] is not None for m in usage)


def test_usage_interval_knob_is_validated(capsys):
    assert client.usage_interval({}) == client.USAGE_INTERVAL_S
    assert client.usage_interval({"GPUSWAP_USAGE_INTERVAL_S": "0.25"}) == 0.25
    for bad in ("0", "-1", "nan", "inf", "1e9", "fast", "0.0001"):
        assert client.usage_interval({"GPUSWAP_USAGE_INTERVAL_S": bad}) == client.USAGE_INTERVAL_S, bad
        assert "ignoring GPUSWAP_USAGE_INTERVAL_S" in capsys.readouterr().err
