"""Why a job waits, as the round that passed it over tells it (policy.decide_explained)."""
import random
from dataclasses import replace

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import POLICIES, Phase, PolicyConfig, SwitchCosts, decide, decide_explained
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.policies import SPECS
from gpuswap.policy.specs import Ctx
from gpuswap.policy.victims import eligible, protection
from policy_helpers import GiB, gpus, job, kinds, snap

SLOW = SwitchCosts(ram_park_bps=1e9, ram_resume_bps=1e9)


def test_switch_cap_is_named_with_its_numbers():
    """The issue's case: a 2-GPU low job (16 GiB to move at 1 GB/s) holds both GPUs; the urgent job
    waits on the switch-time cap, and the reason says so, with the cost and when it lifts."""
    low = job("4", Phase.RUNNING, prio=Priority.LOW, gpus=2, mem_gib=8, assigned=(0, 1), tiers=frozenset({"ram"}))
    urgent = job("5", prio=Priority.URGENT, submit=70, since=70)
    s = snap(80, gpus(2), [low, urgent], costs=SLOW)
    out, waits = decide_explained(s)
    assert out == [] == decide(s)
    w = waits["5"]
    assert w.code == "SwitchCap"
    assert "GPU 0,1 held by job 4" in w.text and "over its 20% switching cap" in w.text
    assert "would spend 35 s" in w.text and "allowed in 61 s" in w.text, w.text
    [b] = w.blockers
    assert b.job_id == "4" and b.numbers["cap"] == 0.2 and round(b.numbers["switch_s"]) == 35
    # Once its life is long enough, the same job is paused: the numbers were the rule's.
    later = decide(snap(80 + b.numbers["allowed_in_s"] + 1, gpus(2), [low, urgent], costs=SLOW))
    assert kinds(later) == [("Pause", "4")]


def test_minimum_runtime_and_no_preempt_and_priority_are_named():
    jobs = [job("3", Phase.RUNNING, prio=Priority.URGENT, assigned=(0,), since=0),
            job("5", Phase.RUNNING, prio=Priority.LOW, assigned=(1,), since=100),
            job("6", Phase.RUNNING, prio=Priority.LOW, assigned=(2,), preemptible=False),
            job("8", Phase.RUNNING, prio=Priority.LOW, assigned=(3,), tiers=frozenset()),
            job("7", prio=Priority.HIGH, gpus=4, submit=110, since=110)]
    s = snap(118, gpus(4), jobs, config=PolicyConfig(min_runtime_s=60))
    out, waits = decide_explained(s)
    assert out == decide(s) == []
    w = waits["7"]
    assert w.text.startswith("waiting for 4 GPUs: ")
    assert "GPU 0 held by job 3 (urgent, not preemptible by a lower priority)" in w.text
    assert ("GPU 1 held by job 5 (protected for 42 s more: the 60 s minimum runtime after a start or "
            "resume (4 x its 1.4 s park + resume in RAM is less))") in w.text
    assert "GPU 2 held by job 6 (not preemptible)" in w.text
    assert "GPU 3 held by job 8 (cannot be parked" in w.text
    assert [b.code for b in w.blockers] == ["Priority", "MinRuntime", "NoPreempt", "NotParkable"]
    assert w.code == "Priority"
    assert w.blockers[1].numbers["seconds_left"] == pytest.approx(42)


def test_pausing_for_it_and_waiting_for_a_pause_in_flight():
    victim = job("1", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), since=0)
    urgent = job("2", prio=Priority.URGENT, submit=100, since=100)
    out, waits = decide_explained(snap(200, gpus(1), [victim, urgent]))
    assert kinds(out) == [("Pause", "1")]
    assert waits["2"].code == "Preempting" and "pausing job 1" in waits["2"].text
    out, waits = decide_explained(snap(201, gpus(1), [replace(victim, phase=Phase.PAUSING), urgent]))
    assert out == []
    assert waits["2"].code == "Preempting" and "job 1 is being parked" in waits["2"].text


def test_a_job_behind_one_the_round_served_says_who_took_the_gpu():
    jobs = [job("1", prio=Priority.HIGH, submit=1), job("2", prio=Priority.NORMAL, submit=0)]
    out, waits = decide_explained(snap(10, gpus(1), jobs))
    assert kinds(out) == [("Start", "1")]
    assert set(waits) == {"2"} and "GPU 0 given to job 1 this round" in waits["2"].text


def test_fifo_says_it_never_preempts():
    jobs = [job("1", Phase.RUNNING, assigned=(0,), since=0), job("2", prio=Priority.URGENT, submit=5)]
    out, waits = decide_explained(snap(1000, gpus(1), jobs), "fifo")
    assert out == []
    assert waits["2"].code == "NoPreemption" and "policy fifo never pauses" in waits["2"].text


def test_every_passed_over_job_is_explained_and_decisions_are_unchanged():
    """Random clusters under every policy: decide_explained gives decide's exact list, and a
    reason for every waiting job that list does not start or resume -- and only for those."""
    rng = random.Random(11)
    for trial in range(300):
        n_gpu = rng.choice([1, 2, 4])
        g = gpus(n_gpu, nodes=rng.choice([1, 2]))
        ids = [x.id for x in g]
        free = list(ids)
        rng.shuffle(free)
        jobs = []
        for i in range(rng.randint(1, 8)):
            want = rng.choice([1, 1, 2, 4])
            prio = rng.choice(list(Priority))
            now_phase = rng.choice([Phase.RUNNING, Phase.PENDING, Phase.PAUSED, Phase.PAUSING])
            node_ids = [x for x in free if x // n_gpu == (free[0] // n_gpu if free else 0)][:want]
            if now_phase in (Phase.RUNNING, Phase.PAUSING) and len(node_ids) == want:
                for x in node_ids:
                    free.remove(x)
                jobs.append(job(str(i), now_phase, prio=prio, gpus=want, assigned=tuple(node_ids),
                                since=rng.uniform(0, 500), attained=rng.uniform(0, 1e5), mem_gib=rng.choice([1, 8, 30]),
                                preemptible=rng.random() > 0.2, tiers=rng.choice([frozenset({"ram", "disk"}),
                                                                                   frozenset({"ram"}), frozenset()])))
            elif now_phase is Phase.PAUSED:
                jobs.append(job(str(i), Phase.PAUSED, prio=prio, gpus=want, parked="disk", since=rng.uniform(0, 500),
                                run_s=rng.uniform(1, 300), attained=rng.uniform(0, 1e5)))
            else:
                jobs.append(job(str(i), prio=prio, gpus=want, submit=rng.uniform(0, 500), since=rng.uniform(0, 500)))
        s = snap(600, g, jobs, config=PolicyConfig(min_runtime_s=rng.choice([0, 60, 600])),
                 costs=rng.choice([SwitchCosts(), SLOW]))
        for policy in POLICIES:
            if policy == "srtf-oracle":
                s = replace(s, jobs=tuple(replace(j, remaining_s=rng.uniform(1, 1e4)) for j in s.jobs))
            out, waits = decide_explained(s, policy)
            assert out == decide(s, policy), (trial, policy)
            served = {d.job_id for d in out if type(d).__name__ in ("Start", "Resume")}
            waiting = {j.id for j in s.jobs if j.phase in (Phase.PENDING, Phase.PAUSED)}
            assert set(waits) == waiting - served, (trial, policy, waits, out)
            assert all(w.text and w.code for w in waits.values())


def test_protection_agrees_with_eligible():
    rng = random.Random(3)
    running = [job(str(i), Phase.RUNNING, assigned=(i,), since=rng.uniform(0, 200),
                   last_start=rng.choice([None, rng.uniform(0, 200)]), preemptible=rng.random() > 0.3,
                   tiers=rng.choice([frozenset(), frozenset({"ram"})])) for i in range(40)]
    s = snap(150, gpus(40), running)
    spec = SPECS["gpuswap"]
    ok, _ = eligible(s, spec, Ctx(s.now, s.config, s.costs, s.usage), ClusterState(s))
    assert {v.id for v in ok} == {v.id for v in running if protection(v, s) is None}
    assert 0 < len(ok) < len(running)
