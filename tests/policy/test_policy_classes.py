"""Classes with limits (issue 15 item 5, policy/classes.py): the class budget, the floor share, the
head start a user within budget keeps, and the reasons that say which rule acted."""
import math

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import Phase, PolicyConfig, decay_usage, decide, decide_explained
from gpuswap.policy.classes import FLOOR, HEAD, limits
from gpuswap.policy.policies import SPECS, make_ctx
from policy_helpers import gpus, job, kinds, snap

LOW, NORMAL, HIGH, URGENT = Priority.LOW, Priority.NORMAL, Priority.HIGH, Priority.URGENT
H = 3600.0
OVER = {("svc", int(URGENT)): 500 * H}          # past the default 192 GPU-h urgent budget
STRICT = PolicyConfig(class_budget_gpu_h=math.inf, class_floor_share=0.0)


def running(id, prio, gpu, user="u", attained=1e4, **kw):
    return job(id, Phase.RUNNING, prio=prio, user=user, assigned=(gpu,), since=0, attained=attained,
               run_s=attained, **kw)


def test_a_user_over_the_urgent_budget_counts_as_high():
    svc = running("svc1", URGENT, 0, user="svc")
    high = job("h", prio=HIGH, user="ann", since=999, submit=999)
    no_floor = PolicyConfig(class_floor_share=0.0)
    out = decide(snap(1000, gpus(1), [svc, high], config=no_floor, class_usage=OVER), "gpuswap")
    assert kinds(out) == [("Pause", "svc1")]
    assert "over the urgent budget" in out[0].reason and "job h (high)" in out[0].reason
    # Within budget, the urgent job keeps its class: the high job waits.
    under = {("svc", int(URGENT)): 100 * H}
    assert decide(snap(1000, gpus(1), [svc, high], config=no_floor, class_usage=under), "gpuswap") == []
    # And without a budget, however much it used.
    strict = PolicyConfig(class_budget_gpu_h=math.inf, class_floor_share=0.0)
    assert decide(snap(1000, gpus(1), [svc, high], config=strict, class_usage=OVER), "gpuswap") == []


def test_the_budget_counts_per_class_and_the_waiting_job_says_why():
    svc = running("svc1", URGENT, 0, user="svc")
    other = job("n", prio=NORMAL, user="ann", since=999, submit=999)
    # High usage does not touch the urgent budget: still urgent, the normal job waits behind it.
    s = snap(1000, gpus(1), [svc, other], config=PolicyConfig(class_floor_share=0.0),
             class_usage={("svc", int(HIGH)): 1e9})
    out, waits = decide_explained(s, "gpuswap")
    assert out == [] and waits["n"].code == "Priority" and "urgent" in waits["n"].text
    # Over it, the urgent job counts as high, still above normal, and the reason says both.
    s = snap(1000, gpus(1), [svc, other], config=PolicyConfig(class_floor_share=0.0), class_usage=OVER)
    out, waits = decide_explained(s, "gpuswap")
    assert out == [] and "high (urgent, its user over the urgent budget)" in waits["n"].text


def test_an_urgent_job_within_budget_keeps_its_head_start_over_the_floors():
    # 8 GPUs full of low jobs; the floor (0.25: 2 GPUs) would protect two of them, but an urgent
    # job of a user within budget pauses any of them: an 8-GPU one starts as under strict classes.
    lows = [running(f"l{i}", LOW, i, attained=1e4 + i) for i in range(8)]
    urgent = job("u", prio=URGENT, user="ann", gpus=8, since=999, submit=999)
    s = snap(1000, gpus(8), lows + [urgent])
    out = decide(s, "gpuswap")
    assert sorted(j for _, j in kinds(out)) == sorted(j.id for j in lows)
    assert decide(snap(1000, gpus(8), lows + [urgent], config=STRICT), "gpuswap") == out


def test_the_floor_protects_a_lower_class_from_a_user_over_budget():
    # 8 GPUs held by low jobs; four 1-GPU urgent services of a user over budget wait. The floor is
    # 2 GPUs: the two most deserving low jobs (least service) stay, the other two are paused.
    lows = [running(f"l{i}", LOW, i, attained=(i + 1) * 4000.0) for i in range(8)]
    svcs = [job(f"s{i}", prio=URGENT, user="svc", since=999, submit=999) for i in range(8)]
    s = snap(1000, gpus(8), lows + svcs, class_usage=OVER)
    out, waits = decide_explained(s, "gpuswap")
    paused = sorted(j for k, j in kinds(out) if k == "Pause")
    assert paused == ["l2", "l3", "l4", "l5", "l6", "l7"]
    assert all("(high (urgent, its user over the urgent budget))" in d.reason for d in out)
    blocked = [w for w in waits.values() if w.job_id.startswith("s") and w.code == "ClassFloor"]
    assert blocked and "floor share (2 GPUs)" in blocked[0].text
    # Strict classes pause them all.
    assert len(decide(snap(1000, gpus(8), lows + svcs, config=STRICT, class_usage=OVER), "gpuswap")) == 8


def test_a_class_under_its_floor_is_lifted_and_takes_gpus_back():
    # Services of a user over budget hold all 8 GPUs; a low job waits. Its class holds nothing, under
    # its floor: it is lifted, pauses a service (the one the order ranks last) and says why.
    svcs = [running(f"s{i}", URGENT, i, user="svc", attained=5e5 if i == 7 else 1e4) for i in range(8)]
    low = job("b", prio=LOW, user="ann", since=999, submit=999)
    s = snap(1000, gpus(8), svcs + [low], class_usage=OVER)
    lim = limits(s, lambda jobs: [(-j.priority, j.submit_time, j.id) for j in jobs])   # own class first, id last
    assert lim.lifted == {"b"} and lim.base == {f"s{i}": int(HIGH) for i in range(8)}
    out = decide(s, "gpuswap")
    assert kinds(out) == [("Pause", "s7")]
    assert "lifted" in out[0].reason and "over the urgent budget" in out[0].reason
    # Strict classes: the low job waits for as long as the services run.
    assert decide(snap(1000, gpus(8), svcs + [low], config=STRICT, class_usage=OVER), "gpuswap") == []
    # A user within budget is not paused for the floor: the head start holds.
    assert decide(snap(1000, gpus(8), svcs + [low]), "gpuswap") == []


def test_the_floor_can_be_passed_by_one_wide_job():
    # A floor of 2 GPUs and an 8-GPU low job: it is lifted (its class holds 0 < 2), or a job wider
    # than the floor would wait behind the services for good.
    svcs = [running(f"s{i}", URGENT, i, user="svc", attained=1e5) for i in range(8)]
    wide = job("w", prio=LOW, user="ann", gpus=8, since=999, submit=999)
    out = decide(snap(1000, gpus(8), svcs + [wide], class_usage=OVER), "gpuswap")
    assert sorted(j for _, j in kinds(out)) == sorted(s.id for s in svcs)


def test_within_the_floor_a_short_job_still_overtakes_a_long_one_of_its_class():
    # Low holds exactly its floor (2 GPUs) beside services of a user over budget. A new low job is not
    # lifted (the class is at its floor) but, within its class, least attained service still wins:
    # it pauses the longest-running protected low job, never a service.
    svcs = [running(f"s{i}", URGENT, i, user="svc", attained=1e5) for i in range(6)]
    lows = [running("old", LOW, 6, attained=2e5), running("mid", LOW, 7, attained=5e3)]
    new = job("new", prio=LOW, user="ann", since=999, submit=999)
    s = snap(1000, gpus(8), svcs + lows + [new], class_usage=OVER)
    ctx = make_ctx(s, SPECS["gpuswap"])
    assert ctx.lim.protected == {"old", "mid"} and not ctx.lim.lifted
    out = decide(s, "gpuswap")
    assert kinds(out) == [("Pause", "old")] and "same class" in out[0].reason


def test_a_lifted_job_is_served_before_others_but_after_a_head_start():
    svcs = [running(f"s{i}", URGENT, i, user="svc", attained=1e5) for i in range(4)]
    low = job("b", prio=LOW, user="ann", since=900, submit=900)
    fresh = job("u", prio=URGENT, user="ann", since=990, submit=990)       # within budget
    demoted = job("d", prio=URGENT, user="svc", since=950, submit=950)     # over budget
    s = snap(1000, gpus(6), svcs + [low, fresh, demoted], class_usage=OVER)
    ctx = make_ctx(s, SPECS["gpuswap"])
    order = sorted([low, fresh, demoted], key=lambda j: SPECS["gpuswap"].order(j, ctx))
    assert [j.id for j in order] == ["u", "b", "d"]
    assert [SPECS["gpuswap"].order(j, ctx)[0] for j in order] == [-(HEAD + int(URGENT)), -FLOOR, -int(HIGH)]
    out = decide(s, "gpuswap")
    assert [(type(d).__name__, d.job_id) for d in out][:2] == [("Start", "u"), ("Start", "b")]


def test_no_floor_on_a_server_too_small_for_one_gpu_of_it():
    # 0.25 of 3 GPUs rounds down to 0: strict classes there.
    svcs = [running(f"s{i}", URGENT, i, user="svc") for i in range(3)]
    low = job("b", prio=LOW, since=999, submit=999)
    assert decide(snap(1000, gpus(3), svcs + [low], config=PolicyConfig(class_budget_gpu_h=math.inf)),
                  "gpuswap") == []


def test_the_priority_policy_stays_strict():
    svcs = [running(f"s{i}", URGENT, i, user="svc") for i in range(8)]
    low = job("b", prio=LOW, since=999, submit=999)
    assert decide(snap(1000, gpus(8), svcs + [low], class_usage=OVER), "priority") == []


def test_class_usage_decays_like_fair_share_usage_whatever_the_steps():
    key = ("svc", int(URGENT))
    one = decay_usage({key: 100.0}, 7200.0, {key: 8 * 7200.0}, 86400.0)
    two = decay_usage(decay_usage({key: 100.0}, 3600.0, {key: 8 * 3600.0}, 86400.0),
                      3600.0, {key: 8 * 3600.0}, 86400.0)
    assert one[key] == pytest.approx(two[key], rel=1e-12) and 100.0 < one[key] < 100.0 + 8 * 7200.0
    idle = decay_usage({key: 1000.0}, 86400.0, {}, 86400.0)
    assert abs(idle[key] - 500.0) < 1e-9
