"""Rules every policy shares: placement, no double-booking, in-flight pauses, minimum runtime."""
from dataclasses import replace

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import POLICIES, Pause, Phase, PolicyConfig, Resume, Spill, Start, SwitchCosts, decide, decide_explained
from policy_helpers import GiB, gpus, job, kinds, snap

PREEMPTIVE = [p for p in POLICIES if p != "fifo"]


def _with_remaining(jobs, policy):
    if policy != "srtf-oracle":
        return jobs
    return [replace(j, remaining_s=10.0 if j.priority == Priority.URGENT else 1e6) for j in jobs]


def test_public_api():
    assert set(POLICIES) == {"fifo", "priority", "las", "gandiva", "srtf-oracle", "gpuswap"}
    with pytest.raises(ValueError, match="unknown policy"):
        decide(snap(0, gpus(1), []), "nope")
    with pytest.raises(ValueError, match="remaining_s"):
        decide(snap(0, gpus(1), [job("a")]), "srtf-oracle")


@pytest.mark.parametrize("policy", POLICIES)
def test_fills_free_gpus_without_double_booking(policy):
    jobs = [job(str(i), gpus=g, submit=i) for i, g in enumerate([2, 1, 4, 1, 2])]
    s = snap(10, gpus(4, nodes=2), _with_remaining(jobs, policy))
    out = decide(s, policy)
    used = [g for d in out for g in d.gpus]
    assert len(used) == len(set(used)) <= 8
    assert all(isinstance(d, Start) for d in out)
    for d in out:   # all of a job's GPUs on one node
        assert len({g // 4 for g in d.gpus}) == 1
    assert sum(len(d.gpus) for d in out) == 8    # 2+1+4+1 fit, and the 2-GPU job backfills nothing


@pytest.mark.parametrize("policy", POLICIES)
def test_deterministic_and_idempotent(policy):
    jobs = [job("r", Phase.RUNNING, assigned=(0,), since=0, attained=5000, run_s=5000),
            job("w", prio=Priority.URGENT, submit=10, since=10), job("x", submit=11, since=11)]
    s = snap(6000, gpus(1), _with_remaining(jobs, policy))
    assert decide(s, policy) == decide(s, policy)


def test_never_splits_a_job_across_nodes():
    s = snap(0, gpus(2, nodes=2), [job("busy1", Phase.RUNNING, assigned=(0,)),
                                    job("busy2", Phase.RUNNING, assigned=(2,)), job("wide", gpus=2)])
    assert decide(s, "fifo") == []


@pytest.mark.parametrize("policy", PREEMPTIVE)
def test_minimum_runtime_is_respected(policy):
    victim = job("low", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), since=997, attained=1e6,
                 run_s=1e6, submit=0)
    urgent = job("u", prio=Priority.URGENT, submit=990, since=990)
    jobs = _with_remaining([victim, urgent], policy)
    assert decide(snap(1000, gpus(1), jobs), policy) == []           # 3 s < its 5.7 s protection
    late = snap(1000 + 31 + 600, gpus(1), jobs)                        # past it (and past a quantum)
    assert kinds(decide(late, policy)) == [("Pause", "low")]


@pytest.mark.parametrize("policy", PREEMPTIVE)
def test_pause_in_flight_is_not_repeated(policy):
    pausing = job("low", Phase.PAUSING, prio=Priority.LOW, assigned=(0,), since=999, attained=1e6)
    other = job("low2", Phase.RUNNING, prio=Priority.LOW, assigned=(1,), since=0, attained=1e6, run_s=1e6)
    urgent = job("u", prio=Priority.URGENT, submit=990, since=990)
    out = decide(snap(1000, gpus(2), _with_remaining([pausing, other, urgent], policy)), policy)
    assert out == []       # the urgent job waits for the GPU the pause in flight frees


@pytest.mark.parametrize("policy", PREEMPTIVE)
def test_non_preemptible_and_runtime_less_jobs_are_never_paused(policy):
    a = job("np", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), attained=1e6, run_s=1e6, preemptible=False)
    b = job("nort", Phase.RUNNING, prio=Priority.LOW, assigned=(1,), attained=1e6, run_s=1e6, tiers=frozenset())
    urgent = job("u", prio=Priority.URGENT, submit=5000, since=5000)
    assert decide(snap(10000, gpus(2), _with_remaining([a, b, urgent], policy)), policy) == []


def test_ram_parked_job_resumes_only_on_its_node():
    parked = job("p", Phase.PAUSED, parked="ram", parked_bytes=4 * GiB, node="n0", since=5)
    busy = job("b", Phase.RUNNING, assigned=(0,), preemptible=False)
    s = snap(100, gpus(1, nodes=2), [parked, busy])
    assert decide(s, "fifo") == [Spill("p", "n0 is busy; moved to disk to resume on another node")]
    disk = job("p", Phase.PAUSED, parked="disk", parked_bytes=4 * GiB, node="n0", since=5)
    assert decide(snap(100, gpus(1, nodes=2), [disk, busy]), "fifo") == [Resume("p", (1,), "resumed on n1 GPU 1")]


def test_a_disk_checkpoint_resumes_only_where_it_is_reachable():
    """In a pool, JobView.disk_nodes: a checkpoint on its node's own disk resumes there alone (and
    a RAM-parked job is not spilled to move where its checkpoint would not be reachable); on
    storage both nodes share, on either."""
    busy = job("b", Phase.RUNNING, assigned=(0,), preemptible=False)
    for policy in ("fifo", "gpuswap"):
        own = job("p", Phase.PAUSED, parked="disk", parked_bytes=4 * GiB, node="n0", since=5, disk_nodes=("n0",))
        assert decide(snap(100, gpus(1, nodes=2), [own, busy]), policy) == [], policy
        shared = replace(own, disk_nodes=("n0", "n1"))
        assert decide(snap(100, gpus(1, nodes=2), [shared, busy]), policy) == [Resume("p", (1,), "resumed on n1 GPU 1")]
        in_ram = job("p", Phase.PAUSED, parked="ram", parked_bytes=4 * GiB, node="n0", since=5, disk_nodes=("n0",))
        assert decide(snap(100, gpus(1, nodes=2), [in_ram, busy]), policy) == [], policy
        movable = replace(in_ram, disk_nodes=("n0", "n1"))
        assert [type(d) for d in decide(snap(100, gpus(1, nodes=2), [movable, busy]), policy)] == [Spill], policy
    _, why = decide_explained(snap(100, gpus(1, nodes=2), [replace(own, disk_nodes=("n2",)), busy]), "gpuswap")
    assert why["p"].text == "its disk checkpoint is reachable only from n2, not in the pool now"


@pytest.mark.parametrize("policy", PREEMPTIVE)
def test_a_job_starts_or_resumes_only_where_its_working_directory_can_be_entered(policy):
    """In a pool, JobView.allowed_nodes (node/workdirs.py): the free GPU on n0 is no place for a job
    whose directory n0 cannot enter; it waits for n1's, and says where it may run. A disk-parked
    job needs both its checkpoint and its directory on one node."""
    busy = job("b", Phase.RUNNING, assigned=(1,), preemptible=False)
    fresh = _with_remaining([job("p", allowed_nodes=("n1",))], policy)[0]
    assert decide(snap(100, gpus(1, nodes=2), [fresh, busy]), policy) == []
    _, why = decide_explained(snap(100, gpus(1, nodes=2), [fresh, busy]), policy)
    assert why["p"].blockers and why["p"].blockers[0].job_id == "b"       # it waits for n1's GPU
    assert [d.gpus for d in decide(snap(100, gpus(1, nodes=2), [replace(fresh, allowed_nodes=("n0", "n1")), busy]),
                                   policy)] == [(0,)]
    _, why = decide_explained(snap(100, gpus(1, nodes=2), [replace(fresh, allowed_nodes=("n2",)), busy]), policy)
    assert why["p"].text == "its working directory can be entered only on n2, which has no GPU now"
    disk = replace(fresh, phase=Phase.PAUSED, parked="disk", parked_bytes=4 * GiB, node="n1",
                   disk_nodes=("n0", "n1"), allowed_nodes=("n1",))
    assert decide(snap(100, gpus(1, nodes=2), [disk, busy]), policy) == []     # n0 reaches its checkpoint only
    assert decide(snap(100, gpus(1, nodes=2), [replace(disk, allowed_nodes=("n0", "n1")), busy]), policy) == \
        [Resume("p", (0,), "resumed on n0 GPU 0")]
    _, why = decide_explained(snap(100, gpus(1, nodes=2), [replace(disk, disk_nodes=("n1",), allowed_nodes=("n0",)),
                                                           busy]), policy)
    assert why["p"].text == ("its disk checkpoint is reachable from n1 and its working directory only on n0: "
                             "no node in the pool now has both")
    in_ram = replace(disk, parked="ram", assigned=(), disk_nodes=("n0", "n1"), allowed_nodes=("n1",))
    assert not [d for d in decide(snap(100, gpus(1, nodes=2), [in_ram, busy]), policy) if isinstance(d, Spill)]


def test_ram_budget_sends_victim_to_disk_and_spills_over_budget():
    victim = job("low", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), mem_gib=8, attained=1e5, run_s=1e5)
    urgent = job("u", prio=Priority.URGENT, submit=500, since=500)
    roomy = decide(snap(1000, gpus(1), [victim, urgent], ram_budget={"n0": 64 * GiB}), "gpuswap")
    assert roomy == [Pause("low", "ram", "preempted by job u (urgent)")]
    tight = decide(snap(1000, gpus(1), [victim, urgent], ram_budget={"n0": 4 * GiB}), "gpuswap")
    assert [(d.job_id, d.tier) for d in tight] == [("low", "disk")]
    parked = job("old", Phase.PAUSED, parked="ram", parked_bytes=8 * GiB, node="n0", since=1)
    busy = job("b", Phase.RUNNING, assigned=(0,), preemptible=False)
    out = decide(snap(1000, gpus(1), [parked, busy], ram_budget={"n0": 4 * GiB}), "gpuswap")
    assert [type(d) for d in out] == [Spill] and out[0].job_id == "old"


def test_reason_names_the_preemptor_and_its_class():
    victim = job("7", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), attained=10, run_s=10)
    out = decide(snap(1000, gpus(1), [victim, job("12", prio=Priority.URGENT, since=999)]), "priority")
    assert out == [Pause("7", "ram", "preempted by job 12 (urgent)")]


def test_fifo_never_preempts():
    victim = job("low", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), attained=1e6, run_s=1e6)
    assert decide(snap(1e6, gpus(1), [victim, job("u", prio=Priority.URGENT)]), "fifo") == []


def test_minimum_runtime_is_configurable():
    victim = job("low", Phase.RUNNING, prio=Priority.LOW, assigned=(0,), since=900)
    s = snap(1000, gpus(1), [victim, job("u", prio=Priority.URGENT, since=999)],
             config=PolicyConfig(min_runtime_s=200))
    assert decide(s, "priority") == []


def test_ram_parked_job_relocates_via_disk_when_its_node_is_full():
    parked = job("p", Phase.PAUSED, parked="ram", parked_bytes=4 * GiB, node="n0", since=5)
    busy = job("b", Phase.RUNNING, assigned=(0,), preemptible=False)
    out = decide(snap(100, gpus(1, nodes=2), [parked, busy]), "gpuswap")
    assert [type(d) for d in out] == [Spill] and "resume on another node" in out[0].reason
    ram_only = job("p", Phase.PAUSED, parked="ram", parked_bytes=4 * GiB, node="n0", since=5,
                   tiers=frozenset({"ram"}))
    assert decide(snap(100, gpus(1, nodes=2), [ram_only, busy]), "gpuswap") == []


def test_batch_orders_and_levels_equal_the_per_job_rules():
    """Specs may give batch forms of `order` and `level` for speed; they must give the same keys
    (waiting jobs with and without starvation promotion, running jobs across the bands, jobs of
    several widths: gpuswap's bands count service per GPU; with and without runtime estimates)."""
    import random

    from gpuswap.policy.policies import SPECS
    from gpuswap.policy.specs import Ctx

    rng = random.Random(7)
    cfg = PolicyConfig()
    ctx = Ctx(1e6, cfg, SwitchCosts(), {"a": 5e4, "b": 1e3})
    waiting, running = [], []
    for i in range(300):
        attained = rng.choice([0.0, rng.uniform(0, 2e6)])
        run_s = attained / max(1, i % 4)
        common = dict(prio=rng.choice(list(Priority)), user=rng.choice("abc"), attained=attained,
                      gpus=rng.choice([1, 1, 2, 4, 8]),
                      run_s=run_s, submit=rng.uniform(0, 1e5), since=rng.uniform(0, 1e6),
                      estimate_s=rng.choice([None, rng.uniform(0, 2e6), run_s]),   # none, any, just outlived
                      weight=rng.choice([1.0, 1.0, 0.5, 3.0]))
        waiting.append(job(f"w{i}", rng.choice([Phase.PENDING, Phase.PAUSED]), **common))
        running.append(job(f"r{i}", Phase.RUNNING, assigned=(0,), **common))
    assert any(s.orders or s.running_levels for s in SPECS.values())
    # and under class limits: jobs demoted over a budget, lifted into a floor, with a head start
    from gpuswap.policy.classes import Limits
    ids = [j.id for j in waiting + running]
    limits = [Limits(base={i: 1 for i in ids[::7]}, lifted=frozenset(ids[1::5]), protected=frozenset(ids[2::9]),
                     floor_gpus=2, head=frozenset(ids[3::4])),
              Limits(lifted=frozenset(ids[::3])), Limits(protected=frozenset(ids[::3]), head=frozenset(ids[1::3])),
              Limits(head=frozenset(ids[::2]))]           # a head start alone holds no limit: strict classes
    # and with the keys the class limits worked out (`Ctx.known`: each job's at its own class) taken
    # over where the job is ordered at its own class, worked out again where a limit moves it
    gs = SPECS["gpuswap"]
    known = dict(zip(ids, gs.orders(waiting + running, ctx)))
    contexts = [Ctx(ctx.now, cfg, ctx.costs, ctx.usage, lim) for lim in limits]
    contexts += [Ctx(ctx.now, cfg, ctx.costs, ctx.usage, lim, known) for lim in limits]
    for c in [ctx] + contexts:
        for spec in SPECS.values():
            if spec.orders:
                assert spec.orders(waiting, c) == [spec.order(j, c) for j in waiting], spec.name
            if spec.running_levels:
                assert spec.running_levels(running, c) == [spec.level(j, c) for j in running], spec.name


def test_gpuswap_benefit_rank_written_out_equals_its_rules():
    """`_gs_benefit_rank` writes `starving`, `own_band` and `expected_left` out where no class limit
    holds (a full round asks it of every job it passes over): the same (group, rank) as the rules,
    for waiting jobs starving or not, of several widths, with and without live estimates."""
    import random

    from gpuswap.policy.classes import Limits
    from gpuswap.policy.gpuswap import GPUSWAP, expected_left, own_band
    from gpuswap.policy.specs import Ctx, starving

    rng = random.Random(11)
    cfg = PolicyConfig()
    ctx = Ctx(1e6, cfg, SwitchCosts(), {"a": 5e4})
    jobs = []
    for i in range(400):
        attained = rng.choice([0.0, rng.uniform(0, 2e6)])
        run_s = rng.choice([0.0, attained / max(1, i % 4)])
        jobs.append(job(f"w{i}", rng.choice([Phase.PENDING, Phase.PAUSED, Phase.RUNNING]),
                        prio=rng.choice(list(Priority)), attained=attained, run_s=run_s,
                        gpus=rng.choice([1, 1, 2, 4, 8]), since=rng.uniform(0, 1e6),
                        estimate_s=rng.choice([None, rng.uniform(0, 2e6), run_s])))
    seen = set()
    for c in (ctx, Ctx(ctx.now, cfg, ctx.costs, ctx.usage, Limits(head=frozenset(j.id for j in jobs[::2])))):
        for w in jobs:
            group, rank = GPUSWAP.benefit_rank(w, c)
            assert (group, rank) == ((w.priority, own_band(w, c) if starving(w, c) else None), expected_left(w))
            seen.add(group[1] is not None)
    assert seen == {True, False}
