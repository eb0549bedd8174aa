"""The daemon as a service: a real daemon started with only a config file honours it, and a
SIGTERM to the daemon alone (what `systemctl stop/restart gpuswap` sends with the shipped unit's
KillMode=process) leaves users' jobs running for the next daemon to take up."""
from __future__ import annotations

import json
import os
import signal
import time

from gpuswap_testing import FACT_TIMEOUT_S, Gate


def _job_pid(home, job: int) -> int:
    """The job's pid once its supervisor has recorded it (RUNNING is recorded before the spawn)."""
    status, deadline = home / "jobs" / str(job) / "run-1" / "status.json", time.monotonic() + FACT_TIMEOUT_S
    while True:
        pid = json.loads(status.read_text()).get("job_pid") if status.exists() else None
        if pid:
            return int(pid)
        assert time.monotonic() < deadline, "the supervisor never recorded the job's pid"
        time.sleep(0.05)


def test_a_daemon_started_with_only_a_config_file_honours_it(make_daemon, home, tmp_path):
    conf = tmp_path / "gpuswap.toml"
    conf.write_text('simulate-gpus = "3x8GiB"\npolicy = "fifo"\nmin-runtime = 0\nram-budget = "5GiB"\n')
    conf.chmod(0o644)
    d = make_daemon("--config", str(conf))          # no --simulate-gpus, no --policy, no --min-runtime
    gpus = json.loads(d.cli("gpus", "--json").stdout)
    assert [g["mem_total"] for g in gpus["gpus"]] == [8 * 2**30] * 3, gpus
    assert all(g["simulated"] for g in gpus["gpus"])
    assert gpus["ram_budget"] == 5 * 2**30, gpus
    assert "policy fifo" in (home / "daemon.out").read_text()


def test_the_default_config_file_of_a_state_directory_is_read(make_daemon, home):
    (home / "gpuswap.toml").write_text('simulate-gpus = "2x4GiB"\n')
    (home / "gpuswap.toml").chmod(0o644)
    d = make_daemon("--min-runtime", "1")
    gpus = json.loads(d.cli("gpus", "--json").stdout)["gpus"]
    assert [g["mem_total"] for g in gpus] == [4 * 2**30] * 2, gpus


def test_sigterm_to_the_daemon_alone_leaves_jobs_running(daemon, home):
    gate = Gate(home / "go")
    job = daemon.submit(gate.hold(before="print('started', flush=True)", then="print('finished')"))
    daemon.state(job, "RUNNING")
    job_pid = _job_pid(home, job)
    daemon.proc.send_signal(signal.SIGTERM)          # systemctl stop, KillMode=process
    assert daemon.proc.wait(120) == 0                # a clean stop
    os.kill(job_pid, 0)                              # the job's process is alive (raises if not)
    daemon.start()                                   # systemctl start: the next daemon takes it up
    assert daemon.job(job)["state"] == "RUNNING"
    gate.open()
    j = daemon.state(job, "COMPLETED")
    log = daemon.cli("logs", str(job)).stdout
    assert log.count("started") == 1 and "finished" in log      # one process, never relaunched
    assert [e["state"] for e in j["events"]] == ["PENDING", "RUNNING", "COMPLETED"]


def test_a_private_daemon_never_reads_the_callers_config(home, tmp_path, monkeypatch):
    """`selftest` and `demo` start daemons of their own: an admin's GPUSWAP_CONFIG (the machine
    daemon's file, its TCP port) must not reach them."""
    from gpuswap.api.client import Client
    from gpuswap.demo.story import start_private_daemon, stop_daemon

    conf = tmp_path / "machine.toml"
    conf.write_text('policy = "fifo"\n')
    conf.chmod(0o644)
    monkeypatch.setenv("GPUSWAP_CONFIG", str(conf))
    proc = start_private_daemon(home, "1", ("--no-calibrate",), timeout=180)
    try:
        assert Client(home).get("/v1/health")["policy"] == "gpuswap"
    finally:
        stop_daemon(proc)
