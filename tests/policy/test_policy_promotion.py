"""gpuswap's starvation promotion (docs/policies.md, gpuswap rule 4): a job promoted for waiting
does not take, by promotion alone, the GPUs of a job that has itself waited as long over its life.
Without that, on a deep queue, starving jobs paused one another as soon as each one's protection
ended (docs/simulator.md, "Thrash on a deep queue")."""
from gpuswap.jobs import Priority
from gpuswap.policy import Phase, PolicyConfig, decide, decide_explained
from policy_helpers import gpus, job, kinds, snap

OLD = PolicyConfig(promotion_spares_starved=False)        # the rule before


def _pair(v_submit: float, v_run: float = 2000.0):
    """A deep queue's pair: v resumed at 5,900 s (past its protection by 6,000 s) with `v_run` of
    service; w parked since 1,000 s with 2,000 s run, so starving (waited >= 2 x 2,000 s)."""
    v = job("v", Phase.RUNNING, assigned=(0,), submit=v_submit, since=5900, last_start=5900,
            attained=v_run, run_s=v_run, switch_s=3.0, switches=1)
    w = job("w", Phase.PAUSED, parked="ram", node="n0", attained=2000, run_s=2000, since=1000,
            last_start=0, switch_s=3.0, switches=1)
    return v, w


def test_a_promoted_job_does_not_take_a_job_that_has_starved_as_long():
    """v has itself waited over twice its run time (life 7,000 s, run 2,000 s): the old rule
    paused it for the promoted w, and v, waiting in turn, would be promoted and take w back."""
    s = snap(6000, gpus(1), _pair(v_submit=-1000))
    assert decide(s, "gpuswap") == []
    old = decide(snap(6000, gpus(1), s.jobs, config=OLD), "gpuswap")
    assert kinds(old) == [("Pause", "v")] and "band 0 < 2" in old[0].reason


def test_a_promoted_job_takes_a_job_that_has_not_starved():
    """v came 2,500 s ago and has run 2,000 s of it: it has not waited twice its run time, so
    the promotion pauses it, as before."""
    s = snap(6000, gpus(1), _pair(v_submit=3500))
    out = decide(s, "gpuswap")
    assert kinds(out) == [("Pause", "v")] and "band 0 < 2" in out[0].reason


def test_a_starved_victim_is_still_paused_where_the_bands_and_the_gate_allow_it():
    """What the promotion gave is taken away, nothing more: v has run 20,000 s (band 5), w 2,000 s
    (band 2), so w may pause it by the usual rule, starved or not."""
    s = snap(30000, gpus(1), _pair(v_submit=-20000, v_run=20000))
    assert kinds(decide(s, "gpuswap")) == [("Pause", "v")]


def test_the_rule_is_named_where_it_holds_a_starving_job():
    s = snap(6000, gpus(1), _pair(v_submit=-1000))
    out, waits = decide_explained(s, "gpuswap")
    assert out == decide(s, "gpuswap") == []
    [b] = waits["w"].blockers
    assert b.code == "PromotionSpared"
    assert "has waited 2x its run time itself" in b.text, b.text


def test_a_higher_class_is_not_held_by_the_rule():
    v, _ = _pair(v_submit=-1000)
    u = job("u", prio=Priority.URGENT, submit=5990, since=5990)
    assert kinds(decide(snap(6000, gpus(1), [v, u]), "gpuswap")) == [("Pause", "v")]
