"""Simulator invariants: no GPU double-booked, every job ends, time never goes backwards, work conserved."""
import pytest

from gpuswap.policy import POLICIES, PolicyConfig
from gpuswap.sim import engine as sim_engine
from gpuswap.sim.costmodel import parse_cost_model
from gpuswap.sim.engine import Cluster, SimError, Simulator, simulate
from gpuswap.sim.trace import TraceJob, load

SMALL = Cluster(nodes=2, gpus_per_node=4, ram_per_node=64 * 1024**3)


def synthetic(n=120):
    """A busy mixed workload: 1/2/4-GPU jobs, short and long, two users, some urgent."""
    jobs = []
    for i in range(n):
        jobs.append(TraceJob(str(i), submit=i * 37.0, duration=[90, 400, 3000, 20000][i % 4],
                             gpus=[1, 1, 2, 4][(i * 7) % 4], user="ab"[i % 2],
                             priority=3 if i % 5 == 0 else 1, mem=(2 + i % 30) * 1024**3))
    return jobs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cost", ["gpuswap", "checkpoint"])
def test_every_job_ends_and_work_is_conserved(policy, cost):
    jobs = synthetic()
    r = simulate(jobs, policy, cluster=SMALL, cost_model=cost, tick_s=60)
    assert all(j.end is not None for j in r.jobs)
    for j in r.jobs:
        assert j.first_start >= j.spec.submit
        assert j.end - j.spec.submit >= j.spec.duration - 1e-6
        assert j.done == pytest.approx(j.spec.duration)
        assert j.attained == pytest.approx(j.spec.duration * j.spec.gpus)
    total = sum(j.duration * j.gpus for j in jobs)
    assert r.busy_gpu_s == pytest.approx(total)
    assert r.busy_gpu_s + r.switch_gpu_s <= 8 * r.makespan + 1e-6      # never more than 8 GPUs busy
    if policy == "fifo":
        assert sum(j.preemptions for j in r.jobs) == 0


def test_time_never_goes_backwards_and_no_gpu_is_double_booked(monkeypatch):
    seen = []
    real = sim_engine.decide

    def spy(snap, policy):
        seen.append(snap.now)
        held = [g for j in snap.jobs if j.phase.value in ("RUNNING", "PAUSING", "RESUMING") for g in j.assigned]
        assert len(held) == len(set(held))
        return real(snap, policy)

    monkeypatch.setattr(sim_engine, "decide", spy)
    simulate(synthetic(), "gpuswap", cluster=SMALL, tick_s=60)
    assert seen and all(a <= b for a, b in zip(seen, seen[1:]))


def test_decisions_come_on_arrivals_finishes_and_parks_not_on_restores(monkeypatch):
    """One GPU: an urgent job preempts a long one while a low-class job waits throughout. The policy
    is asked when each job arrives, when the park completes (to start the urgent job), and when a
    job ends -- not when the long job's restore completes, which frees nothing."""
    seen = []
    real = sim_engine.decide

    def spy(snap, policy):
        seen.append(snap.now)
        return real(snap, policy)

    monkeypatch.setattr(sim_engine, "decide", spy)
    gib8 = 8 * 1024**3
    jobs = [TraceJob("long", 0, 5000, 1, "a", 1, gib8), TraceJob("low", 10, 100, 1, "a", 0, gib8),
            TraceJob("u", 100, 50, 1, "b", 3, gib8)]
    sim = Simulator(jobs, "gpuswap", cluster=Cluster(nodes=1, gpus_per_node=1), tick_s=100_000)
    r = sim.run()
    park, resume = sim.model.costs.park_s(gib8, "ram"), sim.model.costs.resume_s(gib8, "ram")
    end = {j.spec.id: j.end for j in r.jobs}
    assert [j.preemptions for j in r.jobs] == [1, 0, 0] and park > 0 and resume > 0
    assert end["long"] == pytest.approx(5000 + park + 50 + resume)   # restored at 150 + park + resume
    assert seen == pytest.approx([0, 10, 100, 100 + park, 150 + park, end["long"]])


def test_a_double_booking_policy_is_caught(monkeypatch):
    from gpuswap.policy.model import Start

    def greedy(snap, policy):
        return [Start(j.id, (0,)) for j in snap.jobs if j.phase.value == "PENDING"][:2]

    monkeypatch.setattr(sim_engine, "decide", greedy)
    jobs = [TraceJob("0", 0, 10, 1, "u", 1, 1), TraceJob("1", 0, 10, 1, "u", 1, 1)]
    with pytest.raises(SimError, match="double-booked"):
        Simulator(jobs, "fifo", cluster=SMALL).run()


def test_same_seed_same_result(philly_path):
    a = load(philly_path, seed=3, limit=300, gpus_per_node=4)
    b = load(philly_path, seed=3, limit=300, gpus_per_node=4)
    # An hourly tick: determinism does not depend on it, and these 300 jobs keep 8 GPUs backlogged
    # for ~600 simulated days, so every tick is a decision (81,000 with a 10-minute tick: 17 CPU-s
    # a run; hourly, 3 s and still ~900 preemptions)
    ra = simulate(a.jobs, "gpuswap", cluster=SMALL, tick_s=3600)
    rb = simulate(b.jobs, "gpuswap", cluster=SMALL, tick_s=3600)
    assert sum(j.preemptions for j in ra.jobs) > 0       # the policy's time-based rules ran
    assert [(j.end, j.preemptions) for j in ra.jobs] == [(j.end, j.preemptions) for j in rb.jobs]


def test_anti_thrashing_bounds_switching_where_priority_ping_pongs():
    """One GPU, one long low job, a 70 s urgent job every 200 s, 60 s per checkpoint-restart.
    priority pauses the long job for every urgent arrival (30% of its time goes to switching while
    they come); gpuswap's switch-fraction cap (20%) skips preemptions until the share is back under."""
    jobs = [TraceJob("long", 0, 20000, 1, "a", 0, 8 * 1024**3)]
    jobs += [TraceJob(f"u{i}", 100 + 200 * i, 70, 1, "b", 3, 8 * 1024**3) for i in range(80)]
    one = Cluster(nodes=1, gpus_per_node=1)
    prio = simulate(jobs, "priority", cluster=one, cost_model="checkpoint", tick_s=10)
    ours = simulate(jobs, "gpuswap", cluster=one, cost_model="checkpoint", tick_s=10)
    long_p = next(j for j in prio.jobs if j.spec.id == "long")
    long_g = next(j for j in ours.jobs if j.spec.id == "long")
    assert long_p.preemptions == 80                      # one per urgent job: the ping-pong
    assert long_g.preemptions <= 0.7 * long_p.preemptions
    assert long_g.end < long_p.end
    stream_end = 100 + 200 * 80
    assert long_g.switch_s / stream_end <= 0.2 < long_p.switch_s / stream_end


def test_fair_share_converges_to_the_weights():
    """Two always-backlogged users with weights 2:1 on 3 GPUs get GPU time about 2:1."""
    jobs = []
    for i in range(240):
        jobs.append(TraceJob(f"a{i}", 0.0, 100.0, 1, "alice", 1, 1024**3, weight=2.0))
        jobs.append(TraceJob(f"b{i}", 0.0, 100.0, 1, "bob", 1, 1024**3, weight=1.0))
    r = simulate(jobs, "gpuswap", cluster=Cluster(nodes=1, gpus_per_node=3), tick_s=60)
    horizon = 240 * 100 * 3 / 2 / 3          # while both users are still backlogged
    served = {"alice": 0.0, "bob": 0.0}
    for j in r.jobs:
        if j.end <= horizon:
            served[j.spec.user] += j.spec.duration
    share = served["alice"] / (served["alice"] + served["bob"])
    assert share == pytest.approx(2 / 3, abs=0.03)


def test_wake_ups_see_time_based_rules_between_events():
    """`las` on one GPU: A runs from t=0, B arrives at t=10 and waits behind it (same queue, FIFO).
    A crosses the first LAS threshold (3600 GPU-s) at t=3600, with no arrival or completion near:
    only the periodic wake-up sees it, and B preempts A within one tick of it. (The wake-up never
    fired before: B waited for A's completion at t=10,000, whatever the tick.)"""
    gib = 1024**3
    jobs = [TraceJob("a", 0, 10_000, 1, "u", 1, gib), TraceJob("b", 10, 100, 1, "v", 1, gib)]
    calls = {}
    for tick in (60, 300):
        r = simulate(jobs, "las", cluster=Cluster(nodes=1, gpus_per_node=1), tick_s=tick,
                     config=PolicyConfig(min_runtime_s=60))
        a, b = r.jobs
        park = parse_cost_model("gpuswap").costs.park_s(gib, "ram")
        assert a.preemptions == 1 and 3600 <= b.first_start <= 3600 + tick + park
        calls[tick] = r.decide_calls
    assert calls[60] > calls[300]
