"""Why a job waits, end to end: a real daemon's policy says it, and `ls`, `show` and
`/v1/overview` (which `top` and the dashboard draw) all show that same reason, with its numbers."""
from __future__ import annotations

import re
import sys

from gpuswap import simcuda

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]   # no gpuswap runtime: held until the test ends


def flat(text: str) -> str:
    """Table output with its wrapping undone (the REASON cell is the last column)."""
    return " ".join(text.split())


def shown_everywhere(d, job_id: int, text: str) -> None:
    ls = d.cli("ls")
    assert ls.returncode == 0, ls.stderr
    assert text in flat(ls.stdout), ls.stdout
    show = d.cli("show", str(job_id))
    assert show.returncode == 0, show.stderr
    assert text in flat(show.stdout), show.stdout
    [row] = [j for j in d.client.get("/v1/overview")["jobs"] if j["id"] == job_id]
    assert text in row["pending_reason_text"], row


def test_switch_cap_holds_the_urgent_job_and_every_view_says_so(make_daemon):
    """The issue's 145 s wait, shortened (cap 50%): a low job of 16 GiB without the runtime (one
    CUDA process, frozen through the simulated driver; two would be refused as possible NCCL ranks)
    holds the only GPU; the urgent job waits on the switch-time cap, the reason says so with its
    numbers, in ls, show and the overview, an event records it, and once the cap allows it the low
    job is parked and the urgent one runs."""
    d = make_daemon("--simulate-gpus", "1x80GiB", "--min-runtime", "0", "--protect-multiple", "0",
                    "--max-switch-fraction", "0.5",
                    "--ram-budget", "64GiB", calibrate=True)
    # The switch cost is the move at this machine's bandwidth: wait for its calibration (at start).
    d.until(0, lambda g: g["bandwidths"]["ram_park_bps"]["source"].startswith("calibrated"), get="/v1/gpus")
    # One simulated CUDA process of 16 GiB (the strict driver freezes only that).
    ready = d.home / "cuda-ready"
    cuda = ("import sys, time; from gpuswap import simcuda; simcuda.allocate(16 * 2**30); "
            "open(sys.argv[1], 'w').close(); time.sleep(600)")
    low = d.submit(["sh", "-c", f"{sys.executable} -c \"$0\" {ready}; wait", cuda],
                   name="low", priority="low", gpus=1, mem="16GiB")
    d.until(low, lambda j: ready.exists())
    urgent = d.submit(SLEEP, name="urgent", priority="urgent")
    j = d.until(urgent, lambda j: j["pending_reason"] == "SwitchCap" or j["state"] != "PENDING")
    assert j["pending_reason"] == "SwitchCap", j
    [b] = j["pending_blockers"]
    assert b["job_id"] == low and b["code"] == "SwitchCap" and b["numbers"]["cap"] == 0.5
    cost = b["numbers"]["switch_s"]
    m = re.search(r"held by job (\d+) \(would spend (\d+) s parking and resuming it \(ram\), over its 50% "
                  r"switching cap: (\d+) s of a (\d+) s life; allowed in (\d+) s\)", j["pending_reason_text"])
    assert m and int(m[1]) == low and int(m[2]) == round(cost), j["pending_reason_text"]
    shown_everywhere(d, urgent, f"held by job {low} (would spend {m[2]} s parking and resuming it (ram), over its "
                                "50% switching cap")
    assert "SwitchCap: waiting for 1 GPU" in flat(d.cli("ls").stdout)
    # The cap's own numbers say when it lifts; then the policy parks the low job for the urgent one.
    d.state(urgent, "RUNNING", timeout=120 + 2 * b["numbers"]["allowed_in_s"])
    assert d.job(low)["state"] in ("PAUSING", "PAUSED")
    parked = d.state(low, "PAUSED")
    # The simulated driver moves no memory: its park is the job's whole footprint for the RAM
    # budget (its 16 GiB and its CUDA context, as NVML lists them), but its timing teaches no
    # bandwidth (a zero-byte move would be costed as 16 GiB).
    assert parked["parked_bytes"] == 16 * 2**30 + simcuda.DEFAULT_CONTEXT_BYTES, parked
    bw = d.client.get("/v1/gpus")["bandwidths"]["ram_park_bps"]
    assert bw["source"].startswith("calibrated") and bw["samples"] == 0, bw
    events = [e["reason"] for e in d.job(urgent)["events"]]
    assert sum(r.startswith("waiting (SwitchCap)") for r in events) == 1, events   # once, not every tick
    assert d.job(urgent)["pending_reason"] is None


def test_minimum_runtime_no_preempt_and_priority_are_named(make_daemon):
    """Three GPUs held for three different rules; a 3-GPU high job names each holder and rule."""
    # --protect-multiple at its default, named: the reason below states the cost-aware multiple.
    d = make_daemon("--simulate-gpus", "3x80GiB", "--min-runtime", "600", "--protect-multiple", "4")
    top = d.submit(SLEEP, name="top", priority="urgent")
    d.state(top, "RUNNING")
    pinned = d.submit(SLEEP, name="pinned", priority="low", preemptible=False)
    d.state(pinned, "RUNNING")
    young = d.submit(SLEEP, name="young", priority="low")
    d.state(young, "RUNNING")
    want = d.submit(SLEEP, name="want", priority="high", gpus=3)
    j = d.until(want, lambda j: j["pending_reason"] is not None)
    gpu = {b["job_id"]: b["gpus"][0] for b in j["pending_blockers"]}
    assert {b["job_id"]: b["code"] for b in j["pending_blockers"]} == {
        top: "Priority", pinned: "NoPreempt", young: "MinRuntime"}, j
    assert j["pending_reason"] == "Priority"         # the first holder in GPU order
    assert j["pending_reason_text"].startswith("waiting for 3 GPUs: ")
    shown_everywhere(d, want, f"GPU {gpu[top]} held by job {top} (urgent, not preemptible by a lower priority)")
    shown_everywhere(d, want, f"GPU {gpu[pinned]} held by job {pinned} (not preemptible)")
    left = re.search(rf"GPU {gpu[young]} held by job {young} \(protected for (\d+) s more: the 600 s minimum "
                     r"runtime after a start or resume \(4 x its [\d.]+ s park \+ resume in RAM is less\)\)",
                     j["pending_reason_text"])
    assert left and 0 < int(left[1]) <= 600, j["pending_reason_text"]
    shown_everywhere(d, want, f"held by job {young} (protected for ")
    # A job held by its owner off the GPU says so, too (the controller's reason: the policy never sees it).
    events = [e["reason"] for e in d.job(want)["events"]]
    assert any(r.startswith("waiting (Priority): waiting for 3 GPUs") for r in events), events
