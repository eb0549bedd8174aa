"""gpuswap's own rules: classes first, fair share, cheapest victim, benefit over cost, switch cap."""
from gpuswap.jobs import Priority
from gpuswap.policy import Phase, PolicyConfig, SwitchCosts, decide
from policy_helpers import gpus, job, kinds, snap

LOW, URGENT = Priority.LOW, Priority.URGENT


def test_victim_is_the_cheapest_to_park_where_priority_takes_the_newest():
    big = job("big", Phase.RUNNING, prio=LOW, assigned=(0,), mem_gib=70, since=200, attained=1e4, run_s=1e4)
    small = job("small", Phase.RUNNING, prio=LOW, assigned=(1,), mem_gib=2, since=100, attained=1e4, run_s=1e4)
    urgent = job("u", prio=URGENT, since=999)
    s = snap(1000, gpus(2), [big, small, urgent])
    assert kinds(decide(s, "gpuswap")) == [("Pause", "small")]
    assert kinds(decide(s, "priority")) == [("Pause", "big")]      # most recently started


def test_same_class_switch_only_when_benefit_beats_cost():
    slow = SwitchCosts(disk_write_bps=1e6, disk_read_bps=1e6, disk_fixed_s=10)
    victim = job("v", Phase.RUNNING, assigned=(0,), mem_gib=4, attained=4000, run_s=4000,
                 tiers=frozenset({"disk"}))
    new = job("n", submit=4000, since=4000)
    s = snap(4000, gpus(1), [victim, new], costs=slow)      # ~8600 s round trip vs ~4000 s gain
    assert kinds(decide(s, "las")) == [("Pause", "v")]
    assert decide(s, "gpuswap") == []
    cheap = snap(4000, gpus(1), [victim, new])               # ~1 s round trip in RAM
    out = decide(cheap, "gpuswap")
    assert kinds(out) == [("Pause", "v")] and "same class" in out[0].reason


def test_switch_fraction_cap_stops_a_ping_pong_priority_would_do():
    # A low job preempted again and again: 300 s of its 1000 s life already spent switching.
    victim = job("v", Phase.RUNNING, prio=LOW, assigned=(0,), since=800, submit=0, attained=500,
                 run_s=500, switch_s=300)
    urgent = job("u", prio=URGENT, since=999)
    s = snap(1000, gpus(1), [victim, urgent])
    assert kinds(decide(s, "priority")) == [("Pause", "v")]
    assert decide(s, "gpuswap") == []
    relaxed = snap(1000, gpus(1), [victim, urgent], config=PolicyConfig(max_switch_fraction=0.5))
    assert kinds(decide(relaxed, "gpuswap")) == [("Pause", "v")]


def test_fair_share_serves_the_least_served_user_by_weight():
    a = job("a", user="alice", submit=1, weight=1.0)
    b = job("b", user="bob", submit=2, weight=1.0)
    usage = {"alice": 1000.0, "bob": 100.0}
    assert kinds(decide(snap(10, gpus(1), [a, b], usage=usage), "gpuswap")) == [("Start", "b")]
    a_heavy = job("a", user="alice", submit=1, weight=20.0)      # alice's weight makes 1000 -> 50
    assert kinds(decide(snap(10, gpus(1), [a_heavy, b], usage=usage), "gpuswap")) == [("Start", "a")]


def test_classes_come_before_fair_share():
    a = job("a", user="alice", prio=URGENT, submit=1)
    b = job("b", user="bob", submit=0)
    assert kinds(decide(snap(10, gpus(1), [a, b], usage={"alice": 1e9}), "gpuswap")) == [("Start", "a")]


def test_victim_is_the_job_the_order_ranks_last_across_every_node():
    """The job in the highest band goes first, wherever it runs: a cheaper job in a lower band,
    paused instead, would preempt the higher band itself when its turn came (a cascade)."""
    cheap_low_band = job("cheap", Phase.RUNNING, assigned=(0,), mem_gib=1, attained=2000, run_s=2000)
    costly_top_band = job("costly", Phase.RUNNING, assigned=(1,), mem_gib=60, attained=5e5, run_s=5e5)
    new = job("n", submit=6e5, since=6e5)
    s = snap(6e5, gpus(1, nodes=2), [cheap_low_band, costly_top_band, new])
    out = decide(s, "gpuswap")
    assert kinds(out) == [("Pause", "costly")] and "band 0 < 10" in out[0].reason


def test_gpuswap_bands_are_finer_than_las_queues():
    """Both jobs sit in LAS queue 1 (3,600-36,000 GPU-s): las cannot order them; gpuswap's bands can."""
    older = job("older", Phase.RUNNING, assigned=(0,), attained=30000, run_s=30000)
    younger = job("younger", Phase.PAUSED, attained=4000, run_s=4000, parked="disk", since=39000,
                  last_start=0)
    s = snap(40000, gpus(1), [older, younger])
    assert decide(s, "las") == []
    assert kinds(decide(s, "gpuswap")) == [("Pause", "older")]


def test_bands_count_service_per_gpu_so_wide_jobs_are_not_starved():
    """An 8-GPU job that has run 2,000 s (16,000 GPU-s) ranks ahead of 1-GPU jobs that have run
    5,000 s each: bands and the benefit gate count service per GPU. By GPU-seconds (as `las` counts)
    it would rank behind them all and wait for a whole free node."""
    ones = [job(f"one{i}", Phase.RUNNING, assigned=(i,), attained=5000, run_s=5000) for i in range(8)]
    wide = job("wide", Phase.PAUSED, gpus=8, attained=16000, run_s=2000, parked="disk", since=8500,
               last_start=0)
    s = snap(9000, gpus(8), [*ones, wide])
    out = decide(s, "gpuswap")
    assert sorted(kinds(out)) == sorted(("Pause", f"one{i}") for i in range(8))
    assert all("band 2 < 3" in d.reason for d in out)


def test_a_starving_job_may_preempt_like_a_higher_class():
    """Promotion to band 0 after waiting 2x its run time is a promise: the benefit gate, which
    would refuse (the victim has less service than the starving job), does not apply."""
    victim = job("v", Phase.RUNNING, assigned=(0,), since=0, attained=5000, run_s=5000)
    starved = job("s", Phase.PAUSED, parked="disk", attained=20000, run_s=20000, since=1000, last_start=0)
    early = snap(20000, gpus(1), [victim, starved])          # waited 19,000 s < 2 x 20,000 s
    assert decide(early, "gpuswap") == []
    # waited 40,001 s: starving. (The victim has run since it came, 5,000 s ago: it has not
    # starved itself, which would spare it from a promotion; test_policy_promotion.py.)
    victim = job("v", Phase.RUNNING, assigned=(0,), submit=36001, since=36001, attained=5000, run_s=5000)
    late = snap(41001, gpus(1), [victim, starved])
    out = decide(late, "gpuswap")
    assert kinds(out) == [("Pause", "v")]
