"""A spill from RAM to disk that fails (a real full filesystem) must not undo the user's pause."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpuswap_testing import Gate


@pytest.fixture
def full_ckpt_dir(home):
    """Mount a 4 KiB tmpfs over a job's checkpoint directory: any checkpoint write hits ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs to fill the disk needs root")
    mounted: list[str] = []

    def mount(path) -> None:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k,mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounted.append(str(path))

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", path], check=False)


def test_a_failed_spill_keeps_a_user_paused_job_parked_until_resume(daemon, home, full_ckpt_dir,
                                                                    reference_hashes):
    steps, hidden = 120, 256          # ~0.3 MB of parameters and AdamW state: far over 4 KiB
    gate = Gate(home / "s.go")        # it cannot finish (3.6 s of steps) before the test's slow CLI calls
    job = daemon.submit(gate.train(home / "s.json", steps, 0.03, hidden), name="s")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    assert daemon.cli("pause", str(job), "--to", "ram").returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    full_ckpt_dir(home / "jobs" / str(job) / "ckpt")
    assert daemon.cli("pause", str(job), "--to", "disk").returncode == 0      # spill, onto a full disk
    daemon.until(job, lambda j: any(e["reason"].startswith("spill to disk failed") for e in j["events"]))
    # A probe job runs start to finish on the GPU the parked job left: the controller has made
    # many decisions since the failure, and (the bug) would have resumed the parked job first.
    probe = daemon.submit([sys.executable, "-c", "pass"], name="probe")
    daemon.state(probe, "COMPLETED", timeout=120)
    j = daemon.job(job)
    assert j["state"] == "PAUSED" and j["parked"] == "ram", json.dumps(j["events"], indent=1)
    assert not any(e["state"] in ("RESUMING", "RUNNING") for e in j["events"][-3:]), j["events"]
    # It waits for the user's resume, then ends exactly as an uninterrupted run.
    assert daemon.cli("resume", str(job)).returncode == 0
    gate.open()
    daemon.state(job, "COMPLETED", timeout=120)
    assert json.loads((home / "s.json").read_text())["sha256"] == reference_hashes(steps, hidden)
