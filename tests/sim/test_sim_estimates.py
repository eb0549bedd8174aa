"""Runtime estimates in the simulator: learnt as the run goes, never from the future (a job's
estimate comes only from runs that finished before it was submitted), and off with estimates=False."""
from __future__ import annotations

import statistics

import pytest

from gpuswap.policy.estimate import FROM_NAME, FROM_USER, RECENT
from gpuswap.sim.engine import Cluster, simulate
from gpuswap.sim.trace import TraceJob

from test_sim_conservation import SMALL, synthetic

ONE_NODE = Cluster(nodes=1, gpus_per_node=2, ram_per_node=64 * 1024**3)


def fam(id: str, submit: float, duration: float, name: str = "train", user: str = "a") -> TraceJob:
    return TraceJob(id, submit=submit, duration=duration, gpus=1, user=user, priority=1,
                    mem=1024**3, name=name)


def test_an_estimate_uses_only_runs_that_finished_before_the_job_was_submitted():
    """Two GPUs, FIFO. A (0-100) and D (0-10000) take both; E (submitted at 1, 50 s) waits and runs
    100-150. B arrives at 100, the instant A ends: not before, so B has no estimate. F arrives at
    120: the trace says E would be over by 51, but E really ends at 150, so F learns from A alone.
    G arrives at 160, after A and E."""
    jobs = [fam("A", 0, 100), fam("D", 0, 10000, name="other"), fam("E", 1, 50), fam("B", 100, 30),
            fam("F", 120, 10), fam("G", 160, 10)]
    r = simulate(jobs, "fifo", cluster=ONE_NODE, tick_s=60)
    by = {j.spec.id: j for j in r.jobs}
    assert (by["A"].end, by["E"].end) == (100, 150)
    assert by["A"].estimate is None and by["D"].estimate is None and by["E"].estimate is None
    assert by["B"].estimate is None                                  # A ended at its submission, not before
    assert (by["F"].estimate.seconds, by["F"].estimate.runs, by["F"].estimate.source) == (100, 1, FROM_NAME)
    assert (by["G"].estimate.seconds, by["G"].estimate.runs) == (75, 2)   # median of A (100) and E (50)


@pytest.mark.parametrize("policy", ["gpuswap", "las"])
def test_every_estimate_equals_one_recomputed_from_the_runs_ended_before_its_submission(policy):
    """On a busy preemptive run, recompute each job's estimate from the finished run's own record
    (same user and name, ended strictly before the job's submission, the last RECENT by end)."""
    jobs = synthetic(160)
    for j in jobs:
        j.name = f"n{int(j.id) % 3}"
    r = simulate(jobs, policy, cluster=SMALL, tick_s=60)
    done = sorted(r.jobs, key=lambda j: j.end)
    seen = 0
    for j in r.jobs:
        before = [d for d in done if d.end < j.spec.submit and d.spec.user == j.spec.user]
        same = [d.spec.duration for d in before if d.spec.name == j.spec.name]
        runs, source = (same, FROM_NAME) if same else ([d.spec.duration for d in before], FROM_USER)
        if not runs:
            assert j.estimate is None
            continue
        want = statistics.median(runs[-RECENT:])
        # The history holds the run-seconds the simulator counted, summed over a job's runs between
        # preemptions, so they may differ from the trace's duration in the last bits.
        assert j.estimate.seconds == pytest.approx(want, rel=1e-9), (j.spec.id, j.estimate, want)
        assert (j.estimate.source, j.estimate.runs) == (source, len(runs[-RECENT:]))
        seen += 1
    assert seen > 100


def test_estimates_can_be_turned_off():
    r = simulate(synthetic(60), "gpuswap", cluster=SMALL, tick_s=60, estimates=False)
    assert all(j.estimate is None for j in r.jobs)
    r = simulate(synthetic(60), "gpuswap", cluster=SMALL, tick_s=60)
    assert sum(j.estimate is not None for j in r.jobs) > 40


def test_the_trace_family_is_its_name_column_else_the_gpus_asked_for(tmp_path):
    from gpuswap.sim.trace import read_trace

    (tmp_path / "n.csv").write_text("submit,duration,gpus,name\n0,10,1,train\n1,10,2,\n")
    assert [j.name for j in read_trace(str(tmp_path / "n.csv")).jobs] == ["train", "2 GPUs"]
    (tmp_path / "p.csv").write_text("timestamp,duration,num_gpus,cluster\n0,10,1,vc1\n1,10,0.5,vc1\n2,10,16,vc1\n")
    assert [j.name for j in read_trace(str(tmp_path / "p.csv")).jobs] == ["1 GPU", "1 GPU", "16 GPUs"]
