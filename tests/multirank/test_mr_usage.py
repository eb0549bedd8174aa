"""A multi-rank job's usage reports reach the daemon however fast they come. The supervisor folds
a report that comes within USAGE_WRITE_S (0.5 s) of its last status.json write into the next write
(node/statusfile.py); for a multi-rank job that report lives in the coordinator, and the main loop's
write took status as it was, without it. With the ranks' heartbeat at 0.25 s
($GPUSWAP_USAGE_INTERVAL_S) nearly every report came that soon after a write, so rank 0's step
reached the daemon only when one happened to land just after the interval: a 2-rank job held at
its gate showed step None for ~25 s (test_ray_pool's multi-rank node-lost test, 27 s instead of
7 s). Here the ranks report at each step (mr_job.py `--report-each-step`) and not otherwise (the
heartbeat is set to an hour): the last reports, at the step the job holds at, come milliseconds
after the ones before, and the daemon must still show that step while the job holds."""
from __future__ import annotations

from mr_testing import torchrun
from gpuswap_testing import TERMINAL, Gate

STEPS, HOLD = 8, 4


def test_the_last_usage_report_of_ranks_reporting_fast_reaches_the_daemon(make_daemon, home, monkeypatch):
    monkeypatch.setenv("GPUSWAP_USAGE_INTERVAL_S", "3600")     # the job's env copies os.environ
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate = Gate(home / "go")
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(home / "out"), "--gate", str(gate.path),
                            "--hold-at", str(HOLD), "--report-each-step"), name="fast", gpus=2)
    try:
        # Held at step HOLD until the gate opens: nothing reports again before the test opens it.
        j = d.until(job, lambda j: j["state"] in TERMINAL or j["step"] == HOLD)
        assert j["state"] == "RUNNING" and j["step"] == HOLD, j
        assert len(j["ranks"]) == 2 and all(r["connected"] for r in j["ranks"]), j["ranks"]
    finally:
        gate.open()
    assert d.state(job, "COMPLETED", "FAILED")["state"] == "COMPLETED"
