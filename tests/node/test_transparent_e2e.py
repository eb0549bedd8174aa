"""Unmodified jobs (no gpuswap runtime) parked through the driver checkpoint path, end to end in a
real daemon with real processes. Without a GPU the daemon uses its strict SIMULATED device and
driver (gpuswap.simcuda, node/simdriver.py): a job's CUDA process, here a child or grandchild of
a shell as with `bash run.sh` or `torchrun`, registers itself with the simulated device, and the
daemon must find it as it would with NVML; once checkpointed it vanishes from the process list and
its memory from the GPU, its CUDA calls block, and a restore without room leaves it stuck for good."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpuswap.policy.capability import NCCL_TRANSPARENT_REFUSAL
from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES as CTX
from gpuswap_testing import Gate

GiB = 2**30

# A CUDA program stand-in: allocates on the simulated device (which gives it a CUDA context of CTX
# bytes beside what it allocates, as NVML would list it), then makes a CUDA call (which blocks
# while the driver holds it) before printing each line; held before its last line by a gate.
FAKE = """import os, sys, time
from gpuswap import simcuda
nbytes, n, tag, gate, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
simcuda.allocate(nbytes, busy=os.environ.get("FAKE_BUSY") == "1")
open(ready, "w").close()
for i in range(1, n + 1):
    while i == n and not os.path.exists(gate):
        time.sleep(0.05)
    simcuda.sync()
    print(f"{tag}{i}", flush=True)
    time.sleep(0.01)
"""


def fake(home: Path, nbytes: int, gate: Gate, tag: str = "", n: int = 100) -> tuple[str, Path]:
    """(shell command line of a fake CUDA process, the file it creates once it holds its memory)."""
    script = home / "fake_cuda_job.py"
    script.write_text(FAKE)
    ready = home / f"ready{tag}"
    return f"{sys.executable} {script} {nbytes} {n} '{tag}' {gate.path} {ready}", ready


def wait_file(daemon, job_id: int, path: Path) -> None:
    daemon.until(job_id, lambda j: path.exists() or j["state"] not in ("PENDING", "RUNNING"))
    assert path.exists(), daemon.job(job_id)


def gpu0(daemon) -> dict:
    return daemon.client.get("/v1/gpus")["gpus"][0]


def pause_refused(daemon, job_id: int, why: str) -> None:
    """`gpuswap pause` of a job whose freeze the daemon gives up on fails (exit 1) with the reason:
    the request waits the freeze out. (It exited 0 on PAUSING, and the job went back to RUNNING.)"""
    r = daemon.cli("pause", str(job_id))
    assert r.returncode == 1 and "cannot freeze transparently" in r.stderr and why in r.stderr, r


def test_child_cuda_process_of_a_shell_is_frozen_and_thawed(daemon, home):
    # The CUDA process is the shell's child (`; echo end` keeps sh from exec'ing it): the daemon is
    # told no pid, declared 4 GiB, and finds 3 GiB and its CUDA context in the (simulated) NVML
    # process list.
    gate, urgent_gate = Gate(home / "go"), Gate(home / "urgent-go")
    cmd, ready = fake(home, 3 * GiB, gate)
    plain = daemon.submit(["sh", "-c", f"{cmd}; echo end"], name="plain", priority="low", mem="4GiB")
    wait_file(daemon, plain, ready)
    [proc] = gpu0(daemon)["processes"]
    status = json.loads((home / "jobs" / str(plain) / "run-1" / "status.json").read_text())
    assert proc["used_bytes"] == 3 * GiB + CTX and proc["pid"] != status["job_pid"]   # a child, not the shell
    urgent = daemon.submit(urgent_gate.hold(), name="urgent", priority="urgent")
    j = daemon.until(plain, lambda j: j["state"] == "PAUSED")
    assert j["parked"] == "ram" and j["mechanism"] == "transparent"
    assert j["parked_bytes"] == 3 * GiB + CTX                 # measured before the checkpoint, not --mem
    assert "frozen transparently (SIMULATED driver)" in j["reason"] and str(proc["pid"]) in j["reason"]
    daemon.state(urgent, "RUNNING")                           # the GPU went to the other job
    g = gpu0(daemon)
    assert g["processes"] == [] and g["mem_used"] == 0        # gone from NVML, its memory (context too) freed
    assert "SIGSTOP sent" in (home / "jobs" / str(plain) / "run-1" / "supervisor.log").read_text()
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 3 * GiB + CTX
    urgent_gate.open()
    assert daemon.cli("wait", str(urgent)).returncode == 0
    j = daemon.until(plain, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    assert gpu0(daemon)["processes"] == [proc]                # back on the GPU with its memory
    gate.open()
    done = daemon.state(plain, "COMPLETED")
    assert any(e["reason"].startswith("thawed (SIMULATED driver)") for e in done["events"])
    assert daemon.cli("logs", str(plain)).stdout.split() == [str(i) for i in range(1, 101)] + ["end"]
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 0


def test_two_cuda_processes_are_never_frozen_and_the_reason_is_shown(daemon, home):
    """A job whose GPU work is in two CUDA processes (here a child and a grandchild of a shell, as
    the ranks of `torchrun` would be) may be ranks of one NCCL group sharing CUDA IPC memory, which
    the driver does not checkpoint: the pause is refused before any driver call, the job runs on."""
    gate = Gate(home / "go")
    a, ready_a = fake(home, 1 * GiB, gate, tag="a")
    b, ready_b = fake(home, 2 * GiB, gate, tag="b")
    job = daemon.submit(["sh", "-c", f"sh -c \"{a}; true\" & {b}; wait; echo end"], priority="low")
    wait_file(daemon, job, ready_a)
    wait_file(daemon, job, ready_b)
    before = sorted((p["pid"], p["used_bytes"]) for p in gpu0(daemon)["processes"])
    assert len(before) == 2
    pause_refused(daemon, job, NCCL_TRANSPARENT_REFUSAL)
    j = daemon.job(job)
    assert j["transparent_refused"] == NCCL_TRANSPARENT_REFUSAL and j["state"] == "RUNNING", j
    assert any(e["reason"] == f"cannot freeze transparently ({NCCL_TRANSPARENT_REFUSAL}): left running; "
               "not parked transparently again" for e in j["events"])
    # never locked nor checkpointed: both processes still on the GPU with all their memory
    assert sorted((p["pid"], p["used_bytes"]) for p in gpu0(daemon)["processes"]) == before
    shown = " ".join(daemon.cli("show", str(job)).stdout.split())
    assert "cuda-checkpoint does not checkpoint CUDA IPC memory" in shown
    gate.open()
    done = daemon.state(job, "COMPLETED")
    out = daemon.cli("logs", str(done["id"])).stdout      # two writers share the log: lines may interleave
    assert sorted(re.findall(r"[ab]\d+", out)) == sorted([f"{t}{i}" for t in "ab" for i in range(1, 101)])
    assert not any(e["reason"].startswith("frozen") for e in done["events"])


def test_a_pause_of_a_job_with_nothing_to_freeze_fails_with_the_reason(make_daemon, home):
    """A job without the gpuswap runtime and without a CUDA process (here `sleep`), past the grace
    its runtime had to attach (before it, the pause is deferred): its pause goes to the driver,
    which has nothing to freeze, and the daemon gives up at once. `gpuswap pause` used to exit 0
    (it answered on PAUSING) and the job went back to RUNNING; now it exits 1 with the reason, and
    the job runs on, not held."""
    daemon = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--attach-grace", "1")
    job = daemon.submit(["sleep", "300"], priority="low")
    daemon.until(job, lambda j: j["state"] == "RUNNING" and time.time() - j["state_since"] > 2)
    pause_refused(daemon, job, "no CUDA process found in the job's process tree")
    j = daemon.job(job)
    assert j["state"] == "RUNNING" and not j["held"], j
    assert daemon.cli("cancel", str(job)).returncode == 0


def test_lock_timeout_is_reported_as_a_timeout_and_the_job_runs_on(daemon, home):
    gate = Gate(home / "go")
    cmd, ready = fake(home, GiB, gate)
    job = daemon.submit(["sh", "-c", f"FAKE_BUSY=1 {cmd}; echo end"], priority="low")
    wait_file(daemon, job, ready)
    pause_refused(daemon, job, "lock timed out after 10 s")
    j = daemon.job(job)
    assert j["state"] == "RUNNING" and "lock timed out after 10 s" in j["reason"], j["reason"]
    assert gpu0(daemon)["processes"][0]["used_bytes"] == GiB + CTX  # never locked: still on the GPU
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_a_process_its_user_stopped_is_not_frozen_and_the_daemon_goes_on(make_daemon, home):
    """The real driver answers nothing about a SIGSTOPped process (an H100, driver 580.159.04: no
    answer in 15 s, at once after SIGCONT), and the simulated one blocks the same way. A user may
    stop their own job's CUDA process: a pause of it is refused with the reason, and the daemon's
    control loop is never held up by it (another job starts and ends meanwhile). Once continued
    the job can be frozen again: the refusal was the stop, not the job."""
    daemon = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, other_gate = Gate(home / "go"), Gate(home / "other-go")
    cmd, ready = fake(home, GiB, gate)
    job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], priority="low")
    wait_file(daemon, job, ready)
    [own] = daemon.job(job)["assigned_gpus"]
    [proc] = daemon.client.get("/v1/gpus")["gpus"][own]["processes"]
    os.kill(proc["pid"], signal.SIGSTOP)
    try:
        pause_refused(daemon, job, "stopped by a signal")
        j = daemon.job(job)
        assert j["state"] == "RUNNING" and "stopped by a signal" in j["reason"], j["reason"]
        assert daemon.client.get("/v1/gpus")["gpus"][own]["processes"][0]["used_bytes"] == GiB + CTX  # never locked
        other = daemon.submit(other_gate.hold(), name="other", priority="low")
        daemon.state(other, "RUNNING")
        other_gate.open()
        assert daemon.cli("wait", str(other)).returncode == 0
    finally:
        os.kill(proc["pid"], signal.SIGCONT)
    # Refused for the stop alone: once continued (and what the driver took put back) it can be frozen.
    daemon.until(job, lambda j: j["transparent_refused"] is None)
    assert daemon.cli("pause", str(job)).returncode == 0
    j = daemon.until(job, lambda j: j["state"] == "PAUSED" or "cannot freeze" in j["reason"])
    assert j["state"] == "PAUSED" and j["mechanism"] == "transparent", j["reason"]
    assert daemon.cli("resume", str(job)).returncode == 0
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_jobs_their_users_stopped_leave_the_next_freeze_its_answers(make_daemon, home):
    """The undo of each refused freeze asks the driver about the stopped process, which answers
    only once it is continued. Four such undos once held every worker of the control loop's
    state queries: the next job's freeze, of a process that answers at once, waited 5 s for a
    worker and was refused ("no answer about process ... (stopped by a signal?)"), for good."""
    daemon = make_daemon("--simulate-gpus", "5x80GiB", "--min-runtime", "1")
    gate = Gate(home / "go")
    stopped, jobs = [], []
    try:
        for tag in "abcd":
            cmd, ready = fake(home, GiB, gate, tag=tag)
            job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], name=f"stopped-{tag}", priority="low")
            wait_file(daemon, job, ready)
            [own] = daemon.job(job)["assigned_gpus"]
            [proc] = daemon.client.get("/v1/gpus")["gpus"][own]["processes"]
            os.kill(proc["pid"], signal.SIGSTOP)
            stopped.append(proc["pid"])
            jobs.append(job)
            pause_refused(daemon, job, "stopped by a signal")
        cmd, ready = fake(home, GiB, gate, tag="e")
        last = daemon.submit(["sh", "-c", f"{cmd}; echo end"], name="answers", priority="low")
        wait_file(daemon, last, ready)
        assert daemon.cli("pause", str(last)).returncode == 0
        j = daemon.until(last, lambda j: j["state"] != "PAUSING" and j["state"] != "RUNNING"
                         or "cannot freeze" in j["reason"])
        assert j["state"] == "PAUSED" and j["mechanism"] == "transparent", j["reason"]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert daemon.cli("resume", str(last)).returncode == 0
    daemon.until(last, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    for job in jobs + [last]:
        assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_host_ram_budget_counts_what_the_driver_moved_not_the_declared_size(make_daemon, home):
    """Two driver-frozen jobs under a 6 GiB host-RAM budget, each declared at 4 GiB but holding 2 GiB
    and its 0.5 GiB CUDA context (NVML's measure before the lock). The budget counts what each park
    really holds: both fit (5 GiB parked). After the checkpoint NVML lists neither process; a
    footprint read then, falling back to the declared size, would count the first at 4 GiB and
    refuse the second ("not frozen: ... would exceed the host-RAM budget")."""
    daemon = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--ram-budget", "6GiB")
    gate = Gate(home / "go")
    jobs = []
    for tag in "ab":
        cmd, ready = fake(home, 2 * GiB, gate, tag=tag)
        jobs.append(daemon.submit(["sh", "-c", f"{cmd}; echo end"], name=tag, priority="low", mem="4GiB"))
        wait_file(daemon, jobs[-1], ready)
    for job in jobs:          # one after the other: the second's room is what the first left
        assert daemon.cli("pause", str(job)).returncode == 0
        j = daemon.until(job, lambda j: j["state"] == "PAUSED" or "not frozen" in j["reason"])
        assert j["state"] == "PAUSED", j["reason"]
    assert [daemon.job(job)["parked_bytes"] for job in jobs] == [2 * GiB + CTX] * 2   # measured, not declared
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 4 * GiB + 2 * CTX
    for job in jobs:
        assert daemon.cli("resume", str(job)).returncode == 0
    for job in jobs:
        daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    for job in jobs:
        assert daemon.state(job, "COMPLETED")["exit_code"] == 0
    assert daemon.client.get("/v1/gpus")["ram_parked"] == 0


def test_no_restore_into_a_gpu_without_room(make_daemon, home):
    """Someone outside gpuswap takes 6 of the GPU's 8 GiB (its context included) while a job of
    3 GiB and its context is frozen: the daemon waits rather than restore (a restore that runs out
    of memory leaves the process stuck for good, and the simulated driver, like the real one, then
    fails every later restore)."""
    daemon = make_daemon("--simulate-gpus", "1x8GiB", "--min-runtime", "1")
    gate, rogue_gate = Gate(home / "go"), Gate(home / "rogue-go")
    cmd, ready = fake(home, 3 * GiB, gate)
    job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], priority="low")
    wait_file(daemon, job, ready)
    assert daemon.cli("pause", str(job)).returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED")
    rogue_script, rogue_ready = fake(home, 6 * GiB - CTX, rogue_gate, tag="rogue")
    env = dict(os.environ, GPUSWAP_SIM_CUDA_DIR=str(home / "simulated-driver"), CUDA_VISIBLE_DEVICES="0")
    rogue = subprocess.Popen(["sh", "-c", f"exec {rogue_script}"], env=env, stdout=subprocess.DEVNULL)
    try:
        daemon.until(job, lambda j: rogue_ready.exists())
        assert daemon.cli("resume", str(job)).returncode == 0
        j = daemon.until(job, lambda j: "waiting for room" in j["reason"])
        assert j["state"] == "RESUMING" and "GPU 0 has 2.0 GiB free" in j["reason"], j["reason"]
    finally:
        rogue.send_signal(signal.SIGKILL)
        rogue.wait()
    daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_a_frozen_job_waits_for_its_own_gpu_while_another_is_free(make_daemon, home):
    """Every job runs with CUDA_VISIBLE_DEVICES naming its own GPU, and the driver refuses a GPU
    map for such a process (CUDA_ERROR_INVALID_VALUE: NVIDIA/cuda-python#1983, NVBug 5437334), so
    the node offers no migration: resumed while its GPU is taken and another is free, a frozen job
    waits for its own and thaws there. (The simulated driver used to claim migration and moved it.)"""
    daemon = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    assert daemon.client.get("/v1/gpus")["transparent"]["migration"] is False
    gate, other_gate, next_gate = Gate(home / "go"), Gate(home / "other-go"), Gate(home / "next-go")
    cmd, ready = fake(home, 2 * GiB, gate)
    job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], name="plain", priority="low")
    wait_file(daemon, job, ready)
    [own] = daemon.job(job)["assigned_gpus"]
    [proc] = daemon.client.get("/v1/gpus")["gpus"][own]["processes"]
    other = daemon.submit(other_gate.hold(), name="other", priority="low", preemptible=False)
    daemon.state(other, "RUNNING")                              # on the other GPU
    assert daemon.cli("pause", str(job)).returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED")
    nxt = daemon.submit(next_gate.hold(), name="next", priority="normal")
    assert daemon.state(nxt, "RUNNING")["assigned_gpus"] == [own]  # the frozen job's GPU, the one free
    other_gate.open()
    daemon.state(other, "COMPLETED")                            # now the other GPU is free
    assert daemon.cli("resume", str(job)).returncode == 0
    j = daemon.until(job, lambda j: j["state"] != "PAUSED"
                     or "waiting for its own GPU" in (j["pending_reason_text"] or ""))
    assert j["state"] == "PAUSED" and f"waiting for its own GPU {own}" in j["pending_reason_text"], j
    next_gate.open()
    j = daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    assert j["assigned_gpus"] == [own] and not any(" onto GPU" in e["reason"] for e in j["events"])
    assert daemon.client.get("/v1/gpus")["gpus"][own]["processes"] == [proc]
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_job_exiting_while_frozen_ends_with_its_code_and_frees_accounting(daemon, home):
    gate = Gate(home / "go")
    cmd, ready = fake(home, 2 * GiB, gate)
    plain = daemon.submit(["sh", "-c", f"exec {cmd}"], name="plain", priority="low", mem="2GiB")
    wait_file(daemon, plain, ready)
    assert daemon.cli("pause", str(plain)).returncode == 0
    daemon.until(plain, lambda j: j["state"] == "PAUSED" and j["mechanism"] == "transparent")
    status = json.loads((home / "jobs" / str(plain) / "run-1" / "status.json").read_text())
    os.kill(status["job_pid"], signal.SIGKILL)
    j = daemon.state(plain, "FAILED")
    assert j["exit_code"] == 137 and "while paused" in j["reason"]
    assert j["parked"] is None and j["assigned_gpus"] == []
    gpus = daemon.client.get("/v1/gpus")
    assert gpus["ram_parked"] == 0 and gpus["gpus"][0]["jobs"] == []


def test_transparent_only_job_is_not_parked_to_disk(daemon, home):
    plain = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"], name="plain", priority="low",
                          pause_mode="transparent")
    daemon.state(plain, "RUNNING")
    r = daemon.cli("pause", str(plain), "--to", "disk")
    assert r.returncode == 1 and "CRIU" in r.stderr and "Traceback" not in r.stderr
    j = daemon.client.get(f"/v1/jobs/{plain}")
    assert j["state"] == "RUNNING" and j["parked"] is None
    daemon.cli("cancel", str(plain))


def test_a_users_spill_of_a_frozen_job_is_refused_and_it_stays_held_in_ram(daemon, home):
    """Its process tree is stopped by the driver and gpuswap drives no CRIU: a spill to disk cannot be
    made. The controller refuses the user's request (the API answers 409 with why); the job stays
    parked in RAM and held, and resumes on the user's word."""
    gate = Gate(home / "go")
    cmd, ready = fake(home, GiB, gate)
    plain = daemon.submit(["sh", "-c", f"{cmd}; echo end"], name="plain", pause_mode="transparent")
    wait_file(daemon, plain, ready)
    assert daemon.cli("pause", str(plain), "--to", "ram").returncode == 0
    daemon.until(plain, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    r = daemon.cli("pause", str(plain), "--to", "disk")
    assert r.returncode == 1 and "spill to disk refused" in r.stderr and "CRIU" in r.stderr, r
    assert "Traceback" not in r.stderr
    j = daemon.job(plain)
    assert (j["state"], j["parked"], j["held"]) == ("PAUSED", "ram", True), j
    assert daemon.cli("resume", str(plain)).returncode == 0
    daemon.until(plain, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    gate.open()
    daemon.state(plain, "COMPLETED")


def test_daemon_killed_while_a_job_is_frozen_thaws_it_from_its_record(daemon, home):
    """kill -9 of the daemon while the job is frozen: NVML lists nothing of it, so the restarted
    daemon thaws it from the pids and footprint recorded at lock time and the driver's own state."""
    gate = Gate(home / "go")
    cmd, ready = fake(home, 2 * GiB, gate)
    job = daemon.submit(["sh", "-c", f"{cmd}; echo end"], priority="low")
    wait_file(daemon, job, ready)
    [proc] = gpu0(daemon)["processes"]
    assert daemon.cli("pause", str(job)).returncode == 0
    daemon.until(job, lambda j: j["state"] == "PAUSED")
    daemon.kill9()
    daemon.start()
    assert gpu0(daemon)["processes"] == []
    assert daemon.cli("resume", str(job)).returncode == 0
    j = daemon.until(job, lambda j: j["state"] == "RUNNING" and j["parked"] is None)
    assert gpu0(daemon)["processes"] == [proc] and not any("gpuswap failed" in e["reason"] for e in j["events"])
    gate.open()
    assert daemon.state(job, "COMPLETED")["exit_code"] == 0


def test_simulated_device_ignores_forged_planted_and_stale_registrations(tmp_path):
    """The registry is a world-writable directory the root daemon reads: a FIFO planted there must
    not block it, a file naming a process its owner does not run is a forgery, a dead pid is gone."""
    from gpuswap.simcuda import SimDevice, start_ticks
    dev = SimDevice(tmp_path / "dev")
    dev.prepare()
    os.mkfifo(dev.procs / f"{os.getpid()}.json")                       # would block a plain open()
    assert dev.registrations() == []
    os.unlink(dev.procs / f"{os.getpid()}.json")
    other = subprocess.Popen(["sleep", "600"], user=65534)
    try:
        (dev.procs / f"{other.pid}.json").write_text(json.dumps(          # root's file, nobody's process
            {"pid": other.pid, "start": start_ticks(other.pid), "gpu": 0, "nbytes": 1}))
        assert dev.registrations() == []
    finally:
        other.kill()
        other.wait()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (dev.procs / f"{dead.pid}.json").write_text(json.dumps({"pid": dead.pid, "start": 1, "gpu": 0, "nbytes": 1}))
    assert dev.registrations() == [] and not (dev.procs / f"{dead.pid}.json").exists()
