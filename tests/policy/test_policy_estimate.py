"""Runtime estimates (policy/estimate.py) and how gpuswap ranks with them (policy/gpuswap.py):
the predictor's method and sources, `--time` parsing, and the order, victim and gate rules."""
from __future__ import annotations

import pytest

from gpuswap.jobs import parse_time_limit
from gpuswap.policy import decide
from gpuswap.policy.estimate import (FROM_NAME, FROM_TIME, FROM_USER, RECENT, Estimate, History, estimate,
                                     human, remaining)
from gpuswap.policy.model import Pause, Phase, PolicyConfig, Start
from gpuswap.policy.policies import SPECS
from gpuswap.policy.specs import Ctx
from gpuswap.policy.model import SwitchCosts

from policy_helpers import gpus, job, snap

H = 3600.0


# -- the predictor ------------------------------------------------------------------------------
def test_time_limit_comes_first_then_the_family_then_the_user_then_none():
    assert estimate(4 * H, [10.0], [20.0]) == Estimate(4 * H, FROM_TIME, 0)
    assert estimate(None, [100.0, 300.0, 200.0], [5.0]) == Estimate(200.0, FROM_NAME, 3)
    assert estimate(None, [], [5.0, 7.0]) == Estimate(6.0, FROM_USER, 2)
    assert estimate(None, [], []) is None
    assert estimate(0.0, [], []) is None and estimate(float("nan"), [], []) is None   # no usable --time


def test_the_estimate_is_the_median_of_the_most_recent_runs_only():
    old, recent = [1e6] * 10, [100.0, 110.0, 90.0, 5000.0, 105.0]     # one runaway among the recent
    e = estimate(None, old + recent, [])
    assert (e.seconds, e.runs, e.source) == (105.0, RECENT, FROM_NAME)


def test_history_keys_by_user_and_name_and_falls_back_to_the_user():
    h = History().extend([("alice", "train", 2 * H), ("alice", "train", 4 * H), ("alice", "eval", 60.0),
                          ("bob", "train", 100 * H)])
    assert h.estimate("alice", "train") == Estimate(3 * H, FROM_NAME, 2)
    assert h.estimate("alice", "sweep") == Estimate(2 * H, FROM_USER, 3)        # median of 2h, 4h, 60s
    assert h.estimate("carol", "train") is None                                 # other users' runs never count
    assert h.estimate("alice", "train", time_limit_s=H) == Estimate(H, FROM_TIME, 0)


def test_describe_says_the_estimate_and_where_it_came_from():
    assert Estimate(4 * H, FROM_TIME).describe("alice", "train") == "4h from --time"
    assert Estimate(2.1 * H, FROM_NAME, 5).describe("alice", "train") == "2.1h from 5 earlier runs of alice/train"
    assert Estimate(35 * 60, FROM_USER, 1).describe("alice", "x") == "35m from 1 earlier run of alice"
    assert [human(s) for s in (45, 90, 1.5 * 86400)] == ["45s", "2m", "1.5d"]


def test_remaining_is_none_once_the_job_outlives_its_estimate():
    assert remaining(None, 0) is None
    assert remaining(100.0, 30.0) == 70.0
    assert remaining(100.0, 100.0) is None and remaining(100.0, 500.0) is None


@pytest.mark.parametrize("text, seconds", [
    ("90", 90 * 60), ("30:15", 30 * 60 + 15), ("2:30:00", 9000), ("1-12", 36 * H), ("1-0:30", 86400 + 1800),
    ("1-0:30:15", 86400 + 1815), ("4h", 4 * H), ("1d", 86400), ("1.5h", 1.5 * H), ("90s", 90), ("45m", 2700)])
def test_time_limits_read_like_slurm(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0:00", "x", "4x", "-1", "1:2:3:4", "400d", "1e9h"])
def test_bad_time_limits_are_refused_with_a_sentence(text):
    with pytest.raises(ValueError) as e:
        parse_time_limit(text)
    assert "time" in str(e.value) and "\n" not in str(e.value)


# -- the gpuswap policy with estimates ------------------------------------------------------------
CTX = Ctx(10 * 86400.0, PolicyConfig(), SwitchCosts(), {})
ORDER = SPECS["gpuswap"].order
VICTIM = SPECS["gpuswap"].victim


def test_a_nearly_finished_long_job_is_served_before_a_fresh_one_of_the_same_band():
    # Both have run 40 h (the same band); one is estimated at 41 h, the other has no estimate.
    near = job("near", Phase.PAUSED, run_s=40 * H, attained=40 * H, estimate_s=41 * H, since=CTX.now)
    plain = job("plain", Phase.PAUSED, run_s=40 * H, attained=40 * H, since=CTX.now)
    long = job("long", Phase.PAUSED, run_s=40 * H, attained=40 * H, estimate_s=400 * H, since=CTX.now)
    assert ORDER(near, CTX)[:2] == ORDER(plain, CTX)[:2] == ORDER(long, CTX)[:2]     # same class and band
    assert sorted([plain, long, near], key=lambda j: ORDER(j, CTX))[0].id == "near"
    assert sorted([plain, long, near], key=lambda j: ORDER(j, CTX))[-1].id == "long"


def test_a_job_past_its_estimate_ranks_as_one_without_an_estimate():
    kw = dict(run_s=40 * H, attained=40 * H, since=CTX.now, user="u")
    past = job("x", Phase.PAUSED, estimate_s=39 * H, **kw)
    none = job("x", Phase.PAUSED, **kw)
    assert ORDER(past, CTX) == ORDER(none, CTX)
    run_past = job("x", Phase.RUNNING, estimate_s=40 * H, assigned=(0,), **kw)
    run_none = job("x", Phase.RUNNING, assigned=(0,), **kw)
    assert VICTIM(run_past, CTX, 2.0) == VICTIM(run_none, CTX, 2.0)


def test_the_victim_is_the_job_with_most_left_and_one_nearly_done_is_left_alone():
    """Two running day-long jobs of the same band; a fresh job of a lower band arrives. Without
    estimates the cheaper one to park goes (today's rule); with them the one with most left goes,
    and a job its estimate says is a minute from done is not paused for one with more left."""
    now = 100 * H
    def runner(id, mem, est):
        return job(id, Phase.RUNNING, since=now - 30 * H, run_s=30 * H, attained=30 * H, assigned=(int(id[-1]),),
                   mem_gib=mem, estimate_s=est)
    fresh = job("w", submit=now, since=now, estimate_s=2 * H)
    no_est = decide(snap(now, gpus(2), [runner("r0", 1, None), runner("r1", 30, None), fresh]), "gpuswap")
    assert [(type(d), d.job_id) for d in no_est] == [(Pause, "r0")]                 # cheapest to park
    with_est = decide(snap(now, gpus(2), [runner("r0", 1, 30 * H + 60), runner("r1", 30, 300 * H), fresh]),
                      "gpuswap")
    assert [(type(d), d.job_id) for d in with_est] == [(Pause, "r1")]               # most left
    both_near = decide(snap(now, gpus(2), [runner("r0", 1, 30 * H + 60), runner("r1", 30, 30 * H + 60), fresh]),
                       "gpuswap")
    assert both_near == []          # SRTF's gain is negative: the fresh job (2 h left) waits a minute


def test_without_estimates_decisions_are_unchanged_by_the_field():
    now = 100 * H
    jobs = [job("r0", Phase.RUNNING, since=0, run_s=now, attained=now, assigned=(0,)),
            job("w", submit=now, since=now)]
    assert [type(d) for d in decide(snap(now, gpus(1), jobs), "gpuswap")] == [Pause]


def test_the_srtf_oracle_ignores_estimates():
    now = 10 * H
    a = job("a", submit=0, since=0, remaining_s=100.0, estimate_s=1e6)
    b = job("b", submit=1, since=1, remaining_s=5000.0, estimate_s=1.0)
    [d] = decide(snap(now, gpus(1), [a, b]), "srtf-oracle")
    assert (type(d), d.job_id) == (Start, "a")
