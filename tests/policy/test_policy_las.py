"""Tiresias 2D-LAS: discretized attained-service queues, FIFO inside a queue, starvation promotion."""
from gpuswap.policy import Phase, PolicyConfig, decide
from gpuswap.policy.specs import Ctx, las_queue
from gpuswap.policy.model import SwitchCosts
from policy_helpers import gpus, job, kinds, snap


def test_queue_boundaries_follow_thresholds():
    c = Ctx(0, PolicyConfig(las_thresholds_gpu_s=(3600, 36000)), SwitchCosts(), {})
    assert [las_queue(job("a", Phase.RUNNING, attained=a), c) for a in (0, 3599, 3600, 36000)] == [0, 0, 1, 2]


def test_las_demotes_a_job_after_its_threshold():
    new = job("new", submit=5000, since=5000)
    under = job("old", Phase.RUNNING, assigned=(0,), since=0, attained=3500, run_s=3500)
    assert decide(snap(3500, gpus(1), [under, new]), "las") == []            # same queue: FIFO, no preemption
    over = job("old", Phase.RUNNING, assigned=(0,), since=0, attained=3700, run_s=3700)
    out = decide(snap(3700, gpus(1), [over, new]), "las")
    assert kinds(out) == [("Pause", "old")] and "LAS queue 0 < 1" in out[0].reason


def test_multi_gpu_attained_service_counts_gpu_seconds():
    wide = job("wide", Phase.RUNNING, gpus=2, assigned=(0, 1), attained=2 * 2000, run_s=2000)
    out = decide(snap(2000, gpus(2), [wide, job("new", since=1990)]), "las")
    assert kinds(out) == [("Pause", "wide")]          # 4000 GPU-s > 3600 although only 2000 s ran


def test_starving_job_is_promoted_to_the_top_queue():
    cfg = PolicyConfig(las_starvation_factor=2.0)
    starving = job("s", Phase.PAUSED, attained=5000, run_s=100, since=1000, last_start=900, parked="ram",
                   parked_bytes=1, node="n0")
    running = job("r", Phase.RUNNING, assigned=(0,), since=0, attained=8000, run_s=8000, submit=1)
    assert decide(snap(1150, gpus(1), [starving, running], config=cfg), "las") == []  # waited 150 < 200
    out = decide(snap(1250, gpus(1), [starving, running], config=cfg), "las")
    assert kinds(out) == [("Pause", "r")]


def test_las_ignores_priority_classes():
    from gpuswap.jobs import Priority
    low = job("low", prio=Priority.LOW, submit=1)
    urgent = job("urg", prio=Priority.URGENT, submit=2)
    assert kinds(decide(snap(10, gpus(1), [urgent, low]), "las")) == [("Start", "low")]


def test_victim_is_the_job_that_joined_the_lowest_queue_last():
    """Tiresias preempts from the tail of the lowest queue's list: the job that started, resumed
    or was demoted into that queue last -- not the latest submitted."""
    c = PolicyConfig(las_thresholds_gpu_s=(3600, 36000))
    # At t=10,000, both run in queue 1. "early" was submitted first but only started (resumed) at
    # 9,000; "late" was submitted later and has run since 1,000, crossing into queue 1 at 4,600.
    early = job("early", Phase.RUNNING, assigned=(0,), submit=0, since=9000, attained=5000, run_s=5000)
    late = job("late", Phase.RUNNING, assigned=(1,), submit=500, since=1000, attained=9000, run_s=9000)
    new = job("new", submit=10_000, since=10_000)
    out = decide(snap(10_000, gpus(2), [early, late, new], config=c), "las")
    assert kinds(out) == [("Pause", "early")]
    # Demoted into queue 1 at 9,900 (after early's resume at 9,000): it joined last, it goes first.
    late = job("late", Phase.RUNNING, assigned=(1,), submit=500, since=6300, attained=3700, run_s=3700)
    out = decide(snap(10_000, gpus(2), [early, late, new], config=c), "las")
    assert kinds(out) == [("Pause", "late")]
