"""A job without the gpuswap runtime is never silently treated as parked."""
from __future__ import annotations

import json
import sys
import time

from gpuswap_testing import Gate, forever


def test_wait_fallback_keeps_job_running_and_reports_it(make_daemon):
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--pause-timeout", "2")
    plain = d.submit(forever(d.home), name="plain", priority="low", pause_mode="cooperative")
    d.state(plain, "RUNNING")
    urgent = d.submit(["true"], name="urgent", priority="urgent")
    j = d.until(plain, lambda j: any("cannot park" in e["reason"] for e in j["events"]), timeout=30)
    assert j["state"] == "RUNNING" and j["parked"] is None and j["parked_bytes"] == 0
    assert "no gpuswap runtime attached" in j["reason"] and "will not be preempted" in j["reason"]
    time.sleep(1.5)
    assert d.job(urgent)["state"] == "PENDING"          # it waits: nothing was freed
    assert d.job(plain)["preemptions"] == 1 and d.job(plain)["state"] == "RUNNING"   # not asked again
    d.cli("cancel", str(plain))
    d.state(urgent, "COMPLETED", timeout=20)


def test_sigstop_fallback_stops_but_never_counts_memory_as_freed(make_daemon):
    """With exclusive GPUs a SIGSTOPped job frees nothing, so the policy lets it continue at once;
    what matters is that it was stopped for real, reported as holding its memory, and not thrashed."""
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--pause-timeout", "2",
                    "--no-runtime", "sigstop")
    plain = d.submit(forever(d.home), name="plain", priority="low", mem="1GiB", pause_mode="cooperative")
    d.state(plain, "RUNNING")
    urgent = d.submit(["true"], name="urgent", priority="urgent")
    j = d.until(plain, lambda j: any(e["state"] == "PAUSED" for e in j["events"]), timeout=30)
    paused = next(e for e in j["events"] if e["state"] == "PAUSED")
    assert "SIGSTOP" in paused["reason"] and "not counted as freed" in paused["reason"]
    assert j["parked"] is None and j["parked_bytes"] == 0
    sup_log = (d.home / "jobs" / str(plain) / "run-1" / "supervisor.log").read_text()
    assert "SIGSTOP sent to the job's process group" in sup_log
    assert d.client.get("/v1/gpus")["gpus"][0]["mem_used"] == 2**30     # held throughout
    time.sleep(2)
    j = d.job(plain)
    assert j["preemptions"] == 1 and j["state"] == "RUNNING"              # continued, not stopped again
    assert d.job(urgent)["state"] == "PENDING"
    d.cli("cancel", str(plain))
    d.state(urgent, "COMPLETED", timeout=20)


# Attached, then no safepoint until the test opens its gate (slower than any --pause-timeout, for
# as long as the test needs: no window of seconds), then steps of argv[2] seconds.
SLOW_STEPS = """
import os, sys, time, gpuswap
job = gpuswap.attach()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
for step in range(int(sys.argv[1])):
    job.safepoint(step)
    time.sleep(float(sys.argv[2]))
"""


def test_attached_but_slow_job_is_not_preempted_again_after_a_timeout(make_daemon, home):
    """A runtime that is attached but slower between safepoints than --pause-timeout: the pause
    times out once, is withdrawn (the job does not park at its next safepoint anyway), and the
    job is never asked again, although its runtime keeps reporting (it used to loop
    PAUSING -> RUNNING "it will not be preempted" -> PAUSING ... on every tick)."""
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--pause-timeout", "2")
    gate = Gate(home / "slow.go")
    slow = d.submit([sys.executable, "-c", SLOW_STEPS, "4", "6", str(gate.path)], name="slow", priority="low")
    d.until(slow, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    urgent = d.submit(["true"], name="urgent", priority="urgent")
    j = d.until(slow, lambda j: any("cannot park" in e["reason"] for e in j["events"]), timeout=30)
    assert "no safepoint reached within 2 s" in j["reason"] and "will not be preempted" in j["reason"]
    # The daemon withdraws the pause through the job's supervisor, which sends the runtime a
    # `resume`. The job's next safepoint waits for that (the gate opens once it is sent): opened at
    # the daemon's event, the safepoint could come first, take the pause still asked and park (to
    # be resumed at once), a race no withdrawal can win against a safepoint already under way.
    log = d.home / "jobs" / str(slow) / "run-1" / "supervisor.log"
    d.until(slow, lambda j: log.exists() and "sent {'op': 'resume'" in log.read_text(), timeout=30)
    gate.open()
    # Its next safepoint (step 0) has passed. (`(step or -1) >= 0` read step 0 as -1 and waited a
    # 6 s step more, for step 1.)
    d.until(slow, lambda j: j["step"] is not None and j["step"] >= 0, timeout=30)
    time.sleep(1.5)
    j = d.job(slow)
    assert [e["state"] for e in j["events"]].count("PAUSING") == 1, j["events"]
    assert j["preemptions"] == 1 and j["state"] == "RUNNING" and j["parked"] is None
    assert d.job(urgent)["state"] == "PENDING"
    status = json.loads((d.home / "jobs" / str(slow) / "run-1" / "status.json").read_text())
    assert "pause_s" not in status["runtime"], status      # the withdrawn pause never parked it
    assert d.cli("pause", str(slow)).returncode == 1          # nor does a user's pause ask again
    d.cli("cancel", str(slow))
    d.state(urgent, "COMPLETED", timeout=20)


def test_sigstop_fallback_lends_the_gpu_to_a_job_that_fits_beside_the_kept_memory(make_daemon, home):
    """The point of --no-runtime sigstop: the stopped job keeps its GPU memory, and a job whose
    declared footprint fits in what is left computes on that GPU meanwhile; when it ends, the
    stopped job continues."""
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--pause-timeout", "2",
                    "--no-runtime", "sigstop")
    plain = d.submit(forever(d.home), name="plain", priority="low", mem="10GiB", pause_mode="cooperative")
    d.state(plain, "RUNNING")
    gate = Gate(home / "urgent.go")       # RUNNING cannot be missed: it ends when the test says
    urgent = d.submit(gate.hold(), name="urgent", priority="urgent", mem="20GiB")
    u = d.state(urgent, "RUNNING", timeout=30)
    assert "beside a stopped job's memory" in u["events"][-1]["reason"]
    j = d.job(plain)
    assert j["state"] == "PAUSED" and j["parked"] is None and j["parked_bytes"] == 0
    gate.open()
    d.state(urgent, "COMPLETED", timeout=30)
    j = d.until(plain, lambda j: j["state"] == "RUNNING", timeout=30)
    assert "continued (SIGCONT)" in j["events"][-1]["reason"] and j["preemptions"] == 1
    d.cli("cancel", str(plain))
