"""Tier choice by one cost function (RAM, spill-then-RAM, disk, or not at all), jobs pinned to
their own GPUs, and GPUs of a stopped job lent only to jobs that fit beside its memory."""
from gpuswap.jobs import Priority
from gpuswap.policy import Pause, Phase, PolicyConfig, Resume, Spill, Start, SwitchCosts, decide
from gpuswap.policy.costs import park_plan, spill_penalty_gpu_s, switch_s
from policy_helpers import GiB, gpus, job, kinds, snap

LOW, URGENT = Priority.LOW, Priority.URGENT


def _parked(id, gib, **kw):
    return job(id, Phase.PAUSED, prio=LOW, parked="ram", parked_bytes=int(gib * GiB), mem_gib=gib,
               node="n0", since=900, last_start=0, attained=10, run_s=10, **kw)


def test_park_plan_is_the_cheapest_of_ram_spill_then_ram_and_disk():
    costs, cfg = SwitchCosts(), PolicyConfig()
    v = job("v", Phase.RUNNING, mem_gib=4)
    assert park_plan(v, 8 * GiB, tuple, costs, cfg).tier == "ram"              # fits: RAM
    small = _parked("p", 8)
    plan = park_plan(v, 2 * GiB, lambda: (small,), costs, cfg)                    # spilling p is cheaper
    assert plan.tier == "ram" and plan.spill == (small,)
    assert plan.gpu_s == switch_s(v, "ram", costs) + spill_penalty_gpu_s(small, costs)
    assert plan.gpu_s < switch_s(v, "disk", costs)
    huge = _parked("h", 70)                                               # its disk restart costs more
    assert park_plan(v, 2 * GiB, lambda: (huge,), costs, cfg).tier == "disk"
    ram_only = job("r", Phase.RUNNING, mem_gib=4, tiers=frozenset({"ram"}))
    assert park_plan(ram_only, 2 * GiB, tuple, costs, cfg) is None           # nowhere to go: not paused
    assert park_plan(v, 2 * GiB, lambda: (small,), costs, PolicyConfig(allow_disk=False)) is None


def test_spill_to_make_room_comes_first_and_the_victim_waits_for_the_room():
    victim = job("v", Phase.RUNNING, prio=LOW, assigned=(0,), mem_gib=4, attained=1e5, run_s=1e5)
    parked = _parked("p", 8)
    urgent = job("u", prio=URGENT, submit=950, since=950)
    out = decide(snap(1000, gpus(1), [victim, parked, urgent], ram_budget={"n0": 10 * GiB}), "gpuswap")
    assert kinds(out) == [("Spill", "p")] and "making room in host RAM" in out[0].reason
    spilled = job("p", Phase.PAUSED, prio=LOW, parked="disk", parked_bytes=8 * GiB, since=900, last_start=0,
                  attained=10, run_s=10)
    out = decide(snap(1001, gpus(1), [victim, spilled, urgent], ram_budget={"n0": 10 * GiB}), "gpuswap")
    assert out == [Pause("v", "ram", "preempted by job u (urgent)")]


def test_pinned_job_waits_for_its_own_gpu_while_others_use_the_rest():
    """A RAM-parked cooperative job keeps its CUDA context on its GPU: it resumes there or not at
    all, and it must not hold up another GPU meanwhile."""
    pinned = job("pin", Phase.PAUSED, parked="ram", parked_bytes=GiB, node="n0", home_gpus=(0,),
                 since=10, last_start=0, submit=0)
    busy = job("busy", Phase.RUNNING, assigned=(0,), since=990, submit=5)   # within its minimum runtime
    other = job("other", submit=20, since=20)
    out = decide(snap(1000, gpus(2), [pinned, busy, other]), "gpuswap")
    assert out == [Start("other", (1,), "started on n0 GPU 1")]
    free_home = decide(snap(1000, gpus(2), [pinned, other]), "gpuswap")
    assert free_home[0] == Resume("pin", (0,), "resumed on its own GPU 0")


def test_pinned_urgent_job_pauses_the_holder_of_its_gpu():
    pinned = job("pin", Phase.PAUSED, prio=URGENT, parked="ram", parked_bytes=GiB, node="n0",
                 home_gpus=(1,), since=10, last_start=0)
    holder = job("h", Phase.RUNNING, prio=LOW, assigned=(1,), since=0, attained=1e4, run_s=1e4)
    bystander = job("b", Phase.RUNNING, prio=LOW, assigned=(0,), since=0, attained=1e5, run_s=1e5)
    out = decide(snap(1000, gpus(2), [pinned, holder, bystander]), "gpuswap")
    assert kinds(out) == [("Pause", "h")]


def _stopped(mem_gib):
    return job("s", Phase.PAUSED, prio=LOW, assigned=(0,), mem_gib=mem_gib, holds_gpu_while_paused=True,
               since=900, last_start=0)


def test_a_stopped_jobs_gpu_is_lent_to_a_job_that_fits_beside_its_memory():
    g = (gpus(1)[0].__class__(0, "n0", 80 * GiB),)
    fits = job("u", prio=URGENT, mem_gib=20, submit=950, since=950)
    out = decide(snap(1000, g, [_stopped(10), fits]), "gpuswap")
    assert kinds(out) == [("Start", "u")] and "beside a stopped job's memory" in out[0].reason
    too_big = job("u", prio=URGENT, mem_gib=75, submit=950, since=950)
    assert kinds(decide(snap(1000, g, [_stopped(10), too_big]), "gpuswap")) == [("Resume", "s")]
    unknown = job("u", prio=URGENT, mem_gib=0, submit=950, since=950)      # undeclared footprint
    assert kinds(decide(snap(1000, g, [_stopped(10), unknown]), "gpuswap")) == [("Resume", "s")]
    borrower = job("u", Phase.RUNNING, prio=URGENT, mem_gib=20, assigned=(0,), since=990)
    assert decide(snap(1000, g, [_stopped(10), borrower]), "gpuswap") == []    # stays stopped
