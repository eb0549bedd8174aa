"""Classes with limits in the simulator (issue 15 item 5): services that never end starve the batch
jobs under strict classes, and do not with the class budget and floor; the services trace builder."""
import csv
import math
import subprocess
import sys

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import PolicyConfig
from gpuswap.sim.build import services_trace, write
from gpuswap.sim.engine import Cluster, simulate
from gpuswap.sim.trace import TraceJob, load

DAY, H = 86400.0, 3600.0
ONE_NODE = Cluster(nodes=1, gpus_per_node=8, ram_per_node=256 * 1024**3)
BUDGET = PolicyConfig(class_budget_gpu_h=24.0)          # reached after ~3 h of 8 GPUs at urgent
STRICT = PolicyConfig(class_budget_gpu_h=math.inf, class_floor_share=0.0)


def services_and_batch():
    """Eight 1-GPU urgent services of one team, ten days each, fill the 8-GPU node from t=0; a batch
    user submits a 1-hour low job every 2 hours for two days."""
    jobs = [TraceJob(f"svc{i}", submit=float(i), duration=10 * DAY, gpus=1, user="svc",
                     priority=int(Priority.URGENT), mem=8 * 1024**3) for i in range(8)]
    jobs += [TraceJob(f"b{i}", submit=600.0 + i * 2 * H, duration=H, gpus=1, user="batch",
                      priority=int(Priority.LOW), mem=4 * 1024**3) for i in range(24)]
    return jobs


def queues(result, prefix):
    return [j.first_start - j.spec.submit for j in result.jobs if j.spec.id.startswith(prefix)]


def test_strict_classes_starve_batch_jobs_behind_services_that_never_end():
    r = simulate(services_and_batch(), "gpuswap", cluster=ONE_NODE, config=STRICT, tick_s=300)
    assert min(queues(r, "b")) > 8 * DAY          # every batch job waits for the services to end


def test_with_limits_batch_jobs_are_served_and_services_still_start_at_once():
    r = simulate(services_and_batch(), "gpuswap", cluster=ONE_NODE, config=BUDGET, tick_s=300)
    assert all(j.end is not None for j in r.jobs)
    batch = queues(r, "b")
    # The team is within budget for its first ~3 hours (its head start), then counts as high and
    # the low class gets its floor (2 of 8 GPUs): no batch job waits longer than that, plus a tick.
    assert max(batch) < 4 * H
    assert sorted(batch)[len(batch) // 2] < 600    # most wait for no more than a tick or two
    assert max(queues(r, "svc")) <= 30
    assert r.class_usage[("svc", int(Priority.URGENT))] > BUDGET.class_budget_gpu_h * H
    assert ("batch", int(Priority.LOW)) not in r.class_usage   # only urgent and high are budgeted


def test_the_default_budget_lets_a_team_start_all_its_services_first():
    # Under the default budget (192 GPU-h) the team's head start lasts ~1.7 days of 8 GPUs: strict
    # classes meanwhile; but the batch jobs still do not wait for the services' ten days.
    r = simulate(services_and_batch(), "gpuswap", cluster=ONE_NODE, tick_s=300)
    batch = queues(r, "b")
    assert 1 * DAY < max(batch) < 2 * DAY


def test_the_services_trace_is_deterministic_and_has_the_asked_shares(tmp_path):
    a = services_trace(16, 7, seed=3)
    assert a == services_trace(16, 7, seed=3) and a != services_trace(16, 7, seed=4)
    gpu_s = sum(r.duration * r.gpus for r in a)
    svc = sum(r.duration * r.gpus for r in a if r.user.startswith("svc"))
    assert svc / gpu_s == pytest.approx(0.8, abs=0.005)
    assert gpu_s / (16 * 7 * DAY) == pytest.approx(0.7, abs=0.01)
    assert {r.cls for r in a if r.user.startswith("svc")} == {"urgent"}
    assert {r.cls for r in a if r.user.startswith("user")} == {"low", "urgent"}
    path = tmp_path / "svc.csv"
    write(a, str(path))
    trace = load(str(path), seed=0, urgent_fraction=0.1, gpus_per_node=8)
    assert len(trace.jobs) == len(a) and not trace.skipped
    with open(path) as f:
        assert next(csv.reader(f)) == ["submit_time", "duration", "gpus", "user", "class"]


@pytest.mark.parametrize("bad", [["--load", "0"], ["--service-share", "1"], ["--days", "nan"], ["--nodes", "x"]])
def test_the_builder_refuses_bad_options_with_exit_64(tmp_path, bad):
    p = subprocess.run([sys.executable, "-m", "gpuswap.sim.build", "services", "--out", str(tmp_path / "t.csv"), *bad],
                       capture_output=True, text=True)
    assert p.returncode == 64 and "Traceback" not in p.stderr and not (tmp_path / "t.csv").exists()
