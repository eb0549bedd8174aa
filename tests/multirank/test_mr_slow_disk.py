"""A multi-rank disk park whose parts take longer to write than the pause timeout (a large job, a
slow filesystem) completes: the timeout bounds a rank that makes no progress, not a write that is
moving. Before, the coordinator killed every rank once the parking phase outlived the timeout,
failing the job and losing its work since the last checkpoint. A real daemon, torchrun with 2 gloo
ranks, simulated GPUs; rank 1 writes its part as a slow disk would (mr_job.py `--fail-dir`). The
ranks' heartbeat is set to 60 s (`$GPUSWAP_USAGE_INTERVAL_S`, above the timeout): the bytes written
are reported as they move whatever the heartbeat (client.py `PROGRESS_S`); before, they rode on the
heartbeat only, and a heartbeat slower than the timeout killed the job as above."""
from __future__ import annotations

import json

import pytest

from mr_testing import completes_bitwise, torchrun
from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLDS = 12, (6, 10)
TIMEOUT_S = 10       # the pause timeout: enough for the agreement itself on a loaded machine


def _events(j, start):
    return sum(e["reason"].startswith(start) for e in j["events"])


def test_a_disk_park_slower_than_the_pause_timeout_completes(make_daemon, home, monkeypatch):
    monkeypatch.setenv("GPUSWAP_USAGE_INTERVAL_S", str(6 * TIMEOUT_S))    # the job's env copies os.environ
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--pause-timeout", str(TIMEOUT_S))
    gate, out, ref, fail = Gate(home / "go"), home / "out", home / "ref", home / "fail"
    fail.mkdir()
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", ",".join(map(str, HOLDS)), "--fail-dir", str(fail)), name="slow", gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    (fail / "slow-r1").write_text(str(2.5 * TIMEOUT_S))     # its part takes 25 s, moving all along
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    j = d.until(job, lambda j: j["state"] in ("FAILED", "COMPLETED")
                or (j["state"] == "PAUSED" and j["parked"] == "disk"))
    log = (home / "jobs" / str(job) / "run-1" / "supervisor.log").read_text()
    assert j["state"] == "PAUSED" and _events(j, "parked to disk") == 1, (json.dumps(j["events"], indent=1), log[-3000:])
    (fail / "slow-r1").unlink()
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "restarted from its disk checkpoint") == 1)
    completes_bitwise(d, job, gate, ref, out, STEPS)
