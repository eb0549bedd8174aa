"""Cost-aware protection (issue 15, item 1): after a start or resume a job is protected for a
multiple of what a switch of it costs, between a floor and a cap; the switch cap still bounds
thrashing. Fixed clock: every snapshot names its own `now`."""
import random
from dataclasses import replace

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import Phase, PolicyConfig, SwitchCosts, decide, decide_explained
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.costs import switch_s
from gpuswap.policy.policies import SPECS
from gpuswap.policy.specs import Ctx
from gpuswap.policy.victims import eligible, protected_s, protection, round_trip_s
from policy_helpers import GiB, gpus, job, kinds, snap

START = 1000.0
RAM, DISK = frozenset({"ram", "disk"}), frozenset({"disk"})
COSTS = SwitchCosts()                 # 20 GB/s each way to RAM, 0.5 s fixed per park and per resume


def low(mem_gib: float, tiers=RAM, **kw):
    kw.setdefault("submit", 0.0)
    return job("low", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), mem_gib=mem_gib, since=START,
               attained=1e5, run_s=1e5, tiers=tiers, **kw)


def ram_rt(gib: float) -> float:
    return 2 * 0.5 + 2 * gib * GiB / 20e9


def disk_rt(gib: float) -> float:
    return 0.5 + gib * GiB / 1e9 + 10.0 + gib * GiB / 2e9


# (case, victim, config, expected protection in seconds, the reason's words)
CASES = [
    ("cheap: 4 x 1.1 s is under the 5 s floor", low(1), PolicyConfig(), 5.0,
     "the 5.0 s minimum runtime after a start or resume (4 x its 1.1 s park + resume in RAM is less)"),
    ("16 GiB in RAM: 4 x its round trip", low(16), PolicyConfig(), 4 * ram_rt(16),
     "4 x its 2.7 s park + resume in RAM = 11 s after a start or resume"),
    ("60 GiB in RAM: longer", low(60), PolicyConfig(), 4 * ram_rt(60),
     "4 x its 7.4 s park + resume in RAM = 30 s after a start or resume"),
    ("disk only: capped at 60 s", low(16, DISK), PolicyConfig(), 60.0,
     "4 x its 36.3 s park + resume to disk, capped at 60 s"),
    ("its own measured mean: 9 s over 2 preemptions", low(1, switch_s=9.0, switches=2), PolicyConfig(), 18.0,
     "4 x its measured 4.5 s park + resume (mean of 2 preemptions) = 18 s after a start or resume"),
    ("a lower cap", low(60), PolicyConfig(protect_cap_s=20), 20.0,
     "4 x its 7.4 s park + resume in RAM, capped at 20 s"),
    ("a floor above the cap wins (an old min-runtime = 120)", low(60), PolicyConfig(min_runtime_s=120), 120.0,
     "the 120 s minimum runtime after a start or resume (4 x its 7.4 s park + resume in RAM is less)"),
    ("multiple 0: the old fixed minimum runtime", low(60, DISK), PolicyConfig(min_runtime_s=60, protect_multiple=0),
     60.0, "the 60 s minimum runtime after a start or resume"),
    ("no floor, cheap job", low(1), PolicyConfig(min_runtime_s=0), 4 * ram_rt(1),
     "4 x its 1.1 s park + resume in RAM = 4.4 s after a start or resume"),
]


@pytest.mark.parametrize("case, victim, config, expected, words", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("policy", ["gpuswap", "priority"])
def test_protection_follows_the_switch_cost(case, victim, config, expected, words, policy):
    urgent = job("u", prio=Priority.URGENT, submit=START, since=START)
    at = lambda t: snap(t, gpus(1), [victim, urgent], config=config)          # noqa: E731
    assert protected_s(victim, at(START)) == pytest.approx(expected)
    # Just inside it: protected, and the waiting job reads how long and why.
    inside = at(START + expected - 0.5)
    out, waits = decide_explained(inside, policy)
    assert out == decide(inside, policy) == []
    [b] = waits["u"].blockers
    assert b.code == "MinRuntime" and b.numbers["protected_s"] == pytest.approx(expected)
    assert b.numbers["seconds_left"] == pytest.approx(0.5)
    assert b.text == f"protected for 1 s more: {words}", b.text
    # Just past it: paused for the urgent job.
    assert kinds(decide(at(START + expected + 0.5), policy)) == [("Pause", "low")]


def test_a_cheap_job_gives_way_in_seconds_an_expensive_one_later():
    """The issue's case with defaults: an urgent job arriving 6 s after a low job started takes a
    job that parks in about a second at once; one that must go to disk is protected up to 60 s."""
    urgent = job("u", prio=Priority.URGENT, submit=START + 6, since=START + 6)
    cheap, costly = low(2), replace(low(40, DISK), id="costly")
    assert kinds(decide(snap(START + 6, gpus(1), [cheap, urgent]))) == [("Pause", "low")]
    assert decide(snap(START + 6, gpus(1), [costly, urgent])) == []
    assert decide(snap(START + 59.9, gpus(1), [costly, urgent])) == []
    assert kinds(decide(snap(START + 60, gpus(1), [costly, urgent]))) == [("Pause", "costly")]


def test_the_victim_is_taken_from_the_unprotected_jobs():
    """Two low jobs of equal rank: the one still protected is passed over for the other."""
    young = replace(low(16), id="young", assigned=(0,))              # 11 s protection, 8 s in
    older = replace(low(1), id="older", assigned=(1,))               # 5 s protection, 8 s in
    urgent = job("u", prio=Priority.URGENT, submit=START + 8, since=START + 8)
    assert kinds(decide(snap(START + 8, gpus(2), [young, older, urgent]))) == [("Pause", "older")]


def test_the_switch_cap_still_bounds_thrashing():
    """Past its short protection, a job that has already spent a fifth of its life switching is
    not paused, even for an urgent job: the reason is the switch cap, with its numbers."""
    thrashed = low(1, submit=START - 100, switch_s=25.0, switches=10)    # 2.5 s per switch, measured
    urgent = job("u", prio=Priority.URGENT, submit=START + 20, since=START + 20)
    s = snap(START + 20, gpus(1), [thrashed, urgent])
    assert protected_s(thrashed, s) == 10.0 and protection(thrashed, s) is None
    out, waits = decide_explained(s)
    assert out == decide(s) == []
    assert waits["u"].code == "SwitchCap", waits["u"]
    # Once its life is long enough the cap allows it.
    allowed = START + 20 + waits["u"].blockers[0].numbers["allowed_in_s"] + 1
    assert kinds(decide(snap(allowed, gpus(1), [thrashed, urgent]))) == [("Pause", "low")]


def test_round_trip_is_the_cost_model_until_measured():
    v = low(16)
    s = snap(START, gpus(1), [v])
    assert round_trip_s(v, s) == (switch_s(v, "ram", COSTS), "ram")
    assert round_trip_s(low(16, DISK), s) == (switch_s(v, "disk", COSTS), "disk")
    wide = job("w", Phase.RUNNING, gpus=8, width=8, mem_gib=12, assigned=tuple(range(8)), since=START)
    assert round_trip_s(wide, s)[0] == pytest.approx(switch_s(wide, "ram", COSTS))    # group teardown and rebuild
    assert round_trip_s(replace(v, switch_s=7.0, switches=2), s) == (3.5, "measured")
    assert round_trip_s(replace(v, switch_s=7.0, switches=0), s)[1] == "ram"   # a user's pause: no count, model


@pytest.mark.parametrize("seed", range(5))
def test_protection_agrees_with_eligible_under_any_settings(seed):
    """`protection` (the reasons) and `eligible` (the decisions) apply one rule, to the bit."""
    rng = random.Random(seed)
    config = PolicyConfig(min_runtime_s=rng.choice([0.0, 5.0, 60.0]), protect_multiple=rng.choice([0.0, 1.5, 4.0]),
                          protect_cap_s=rng.choice([0.0, 10.0, 60.0]))
    now = 200.0
    running = [job(str(i), Phase.RUNNING, assigned=(i,), since=rng.uniform(100, 200),
                   last_start=rng.choice([None, rng.uniform(100, 200), now - 60.0, now - 5.0]),
                   mem_gib=rng.choice([0.5, 8, 40, 78]), switch_s=rng.uniform(0, 50), switches=rng.choice([0, 0, 3]),
                   preemptible=rng.random() > 0.2, tiers=rng.choice([frozenset(), RAM, DISK]))
               for i in range(60)]
    s = snap(now, gpus(60), running, config=config)
    ok, _ = eligible(s, SPECS["gpuswap"], Ctx(s.now, s.config, s.costs, s.usage), ClusterState(s))
    assert {v.id for v in ok} == {v.id for v in running if protection(v, s) is None}
    assert 0 < len(ok) < len(running)
