"""A job's processes never outlive its supervisor unnoticed (issue 10, item 6): `kill -9` of the
supervisor kills the job's whole session, the job ends FAILED saying so, its GPU goes to the next
job only once nothing of it runs, and its checkpoint is kept."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from gpuswap_testing import train_cmd


def _status(home: Path, job: int) -> dict:
    path = home / "jobs" / str(job) / "run-1" / "status.json"
    deadline = time.monotonic() + 180
    while not (path.exists() and json.loads(path.read_text()).get("job_pid")):
        assert time.monotonic() < deadline, "no job pid recorded"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting for a reaper that may never come)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] not in (b"Z", b"X")


def test_killing_a_running_jobs_supervisor_kills_its_session_before_its_gpu_is_reused(daemon, home, tmp_path):
    pids = tmp_path / "pids"
    # The shell and a child of it that PR_SET_PDEATHSIG does not cover (it is not the main process).
    orphan = daemon.submit(["sh", "-c", f'echo $$ > {pids}.tmp; sleep 600 & echo $! >> {pids}.tmp; '
                                        f'mv {pids}.tmp {pids}; echo kept > "$GPUSWAP_CKPT_DIR/ckpt-000001.pt"; wait'])
    daemon.state(orphan, "RUNNING")
    ckpt = home / "jobs" / str(orphan) / "ckpt" / "ckpt-000001.pt"
    deadline = time.monotonic() + 180
    while not (pids.exists() and ckpt.exists()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The next job waits for the only GPU; when it starts, it reports which of those still run.
    check = (f'for p in $(cat {pids}); do [ -r /proc/$p/stat ] && echo "$(cut -d" " -f1,3 /proc/$p/stat)"; '
             'done; echo checked')
    nxt = daemon.submit(["sh", "-c", check])
    assert daemon.job(nxt)["state"] == "PENDING"
    os.kill(_status(home, orphan)["supervisor_pid"], signal.SIGKILL)
    j = daemon.state(orphan, "FAILED")
    assert "supervisor died" in j["reason"] and "processes were killed" in j["reason"], j["reason"]
    assert not any(_alive(int(p)) for p in pids.read_text().split())
    daemon.state(nxt, "COMPLETED")
    seen = daemon.cli("logs", str(nxt)).stdout.splitlines()
    assert seen[-1] == "checked" and all(line.split()[1] in ("Z", "X") for line in seen[:-1]), seen
    assert ckpt.read_text() == "kept\n"                       # a failed job's checkpoint stays


def test_killing_a_ram_parked_jobs_supervisor_kills_it_and_frees_its_ram(daemon, home):
    long_id = daemon.submit(train_cmd(home / "long.json", 100000), name="long", priority="low")
    daemon.until(long_id, lambda j: j["state"] == "RUNNING" and (j["step"] or 0) >= 5)
    urgent = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"], name="urgent", priority="urgent")
    daemon.until(long_id, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    daemon.state(urgent, "RUNNING")
    status = _status(home, long_id)
    assert _alive(status["job_pid"]) and daemon.client.get("/v1/gpus")["ram_parked"] > 0
    os.kill(status["supervisor_pid"], signal.SIGKILL)
    j = daemon.state(long_id, "FAILED")
    assert "processes were killed" in j["reason"], j["reason"]
    assert not _alive(status["job_pid"])                      # gone before its RAM counts as free
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 0
    assert (home / "jobs" / str(long_id) / "ckpt").is_dir()
    daemon.cli("cancel", str(urgent))
