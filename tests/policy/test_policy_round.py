"""What a round keeps to decide fast with a deep queue gives the rules' own decisions: the lazy
queue, the victim plans kept per node, and the signature they are kept under."""
import random

from gpuswap.jobs import Priority
from gpuswap.policy import Pause, Phase, PolicyConfig, SwitchCosts, decide
from gpuswap.policy.cluster import ClusterState
from gpuswap.policy.preemption import Preemption
from gpuswap.policy.queue import Queue
from gpuswap.policy.policies import SPECS
from gpuswap.policy.specs import Ctx
from policy_helpers import gpus, job, kinds, snap


def test_queue_gives_the_sorted_order_and_what_is_left():
    rng = random.Random(3)
    jobs = [job(f"j{i}", Phase.PAUSED if i % 3 else Phase.PENDING, parked="ram" if i % 3 == 1 else None,
                submit=rng.uniform(0, 100)) for i in range(50)]
    keys = [(j.submit_time, j.id) for j in jobs]
    q = Queue(jobs, keys)
    it = iter(q)
    first = [next(it) for _ in range(20)]
    ranked = sorted(zip(keys, jobs), key=lambda e: e[0])
    assert first == ranked[:20]
    wanted = [i for i, j in enumerate(jobs) if int(j.id[1:]) % 5 == 0]
    assert q.rest(wanted) == [e for e in ranked[20:] if int(e[1].id[1:]) % 5 == 0]
    assert q.in_ram() == [j for _, j in ranked if j.parked == "ram"]    # taken or not


def test_every_policys_order_key_ends_with_the_job_id():
    """The queue finds a popped key's job by the key's last element (queue.py): every policy's key,
    single or batch, must end with the job's id (unique in a snapshot, so no two keys tie)."""
    rng = random.Random(5)
    jobs = [job(f"j{i}", Phase.PAUSED if i % 2 else Phase.PENDING, prio=rng.choice(list(Priority)),
                gpus=rng.choice([1, 2, 4]), submit=rng.uniform(0, 100), since=rng.uniform(0, 100),
                attained=rng.uniform(0, 1e5), run_s=rng.uniform(0, 1e4), remaining_s=rng.uniform(1, 1e4))
            for i in range(40)]
    s = snap(1000, gpus(8), jobs)
    ctx = Ctx(s.now, s.config, s.costs, s.usage)
    for name, spec in SPECS.items():
        keys = [spec.order(j, ctx) for j in jobs]
        assert [k[-1] for k in keys] == [j.id for j in jobs], name
        if spec.orders is not None:
            assert spec.orders(jobs, ctx) == keys, name


def test_wide_jobs_pause_where_the_victim_order_says_each_after_the_last_took_its_node():
    """Three 2-GPU urgent jobs of one kind, three full nodes: each goes where the victims come
    first in victim order (the most recently started low job), and a later one never reuses a
    plan made for a node an earlier one has taken."""
    now = 1000.0
    running = [job("low-old", Phase.RUNNING, prio=Priority.LOW, gpus=2, assigned=(0, 1), since=50),
               job("low-new", Phase.RUNNING, prio=Priority.LOW, gpus=2, assigned=(2, 3), since=80),
               job("normal", Phase.RUNNING, prio=Priority.NORMAL, gpus=2, assigned=(4, 5), since=10)]
    waiting = [job(f"u{i}", prio=Priority.URGENT, gpus=2, submit=900 + i, since=900 + i) for i in range(3)]
    out = decide(snap(now, gpus(2, nodes=3), running + waiting), "priority")
    assert kinds(out) == [("Pause", "low-new"), ("Pause", "low-old"), ("Pause", "normal")]
    assert all(isinstance(d, Pause) for d in out)
    # Alone, the second and third would have chosen the first one's node.
    out2 = decide(snap(now, gpus(2, nodes=3), running + waiting[1:]), "priority")
    assert kinds(out2)[0] == ("Pause", "low-new")


def test_gpuswap_benefit_reads_the_waiting_job_only_through_its_benefit_rank():
    """The round keeps victim plans per (level, GPUs, benefit_rank): two waiting jobs with equal
    ranks must get the same benefit answer for every victim and cost."""
    spec = SPECS["gpuswap"]
    rng = random.Random(11)
    ctx = Ctx(1e5, PolicyConfig(), SwitchCosts(), {"a": 1e4})
    seen = 0
    for _ in range(400):
        attained = rng.choice([0.0, 3600.0, rng.uniform(0, 1e5)])
        common = dict(prio=rng.choice(list(Priority)), attained=attained, run_s=rng.choice([0.0, 500.0, 1e5]),
                      since=rng.uniform(0, 1e5))
        g = rng.choice([1, 2, 4])
        w1 = job("w1", rng.choice([Phase.PENDING, Phase.PAUSED]), gpus=g, user="a", submit=1.0, **common)
        w2 = job("w2", w1.phase, gpus=g, user="b", submit=2.0, mem_gib=40, **common)   # same rank, other fields
        assert spec.benefit_rank(w1, ctx) == spec.benefit_rank(w2, ctx)
        v = job("v", Phase.RUNNING, prio=rng.choice(list(Priority)), gpus=rng.choice([1, 2]), assigned=(0,),
                attained=rng.uniform(0, 2e5), since=0)
        cost = rng.choice([0.5, 5.0, 50.0, 5e3])
        assert spec.benefit_ok(w1, v, ctx, cost) == spec.benefit_ok(w2, v, ctx, cost)
        seen += spec.benefit_ok(w1, v, ctx, cost)
    assert 0 < seen < 400       # both answers were exercised


def test_gpuswap_lifted_jobs_share_a_benefit_rank_and_its_answers():
    """Lifted jobs (their class under its floor) rank alike whatever their estimates and service,
    so a round plans once per width for them; their gate must then answer alike for every victim."""
    from gpuswap.policy.classes import Limits

    spec = SPECS["gpuswap"]
    rng = random.Random(13)
    seen = 0
    for trial in range(300):
        prio = rng.choice([Priority.LOW, Priority.NORMAL])
        w1 = job("w1", Phase.PENDING, prio=prio, attained=rng.uniform(0, 1e5), run_s=rng.uniform(0, 1e4),
                 since=rng.uniform(0, 1e5), estimate_s=rng.choice([None, rng.uniform(1, 1e5)]))
        w2 = job("w2", Phase.PAUSED, prio=prio, attained=rng.uniform(0, 1e5), run_s=rng.uniform(1, 1e4),
                 since=rng.uniform(0, 1e5), estimate_s=rng.choice([None, rng.uniform(1, 1e5)]))
        v = job("v", Phase.RUNNING, prio=rng.choice(list(Priority)), assigned=(0,), attained=rng.uniform(0, 2e5))
        protected = frozenset({"v"}) if rng.random() < 0.3 else frozenset()
        lim = Limits(lifted=frozenset({"w1", "w2"}), protected=protected, floor_gpus=2)
        ctx = Ctx(1e5, PolicyConfig(), SwitchCosts(), {"u": 1e4}, lim)
        assert spec.benefit_rank(w1, ctx) == spec.benefit_rank(w2, ctx)
        cost = rng.choice([0.5, 50.0, 5e3])
        assert spec.benefit_ok(w1, v, ctx, cost) == spec.benefit_ok(w2, v, ctx, cost)
        seen += spec.benefit_ok(w1, v, ctx, cost)
    assert 0 < seen < 300       # both answers were exercised


def test_a_full_cluster_nobody_may_be_preempted_on_decides_as_the_whole_round_would():
    """On a full cluster where no waiting job's level is below every victim's, `decide` skips the
    round (`Spec.none_below`); `decide_explained` always runs it. Both must decide alike, and the
    cases where the skip applies and where it does not must both occur."""
    from gpuswap.policy import decide_explained

    rng = random.Random(5)
    skipped = {name: 0 for name, spec in SPECS.items() if spec.none_below}
    for trial in range(60):
        now, young = 1e5, rng.random() < 0.4        # young: all within their first time slice
        running = [job(f"r{i}", Phase.RUNNING, prio=rng.choice([Priority.LOW, Priority.NORMAL, Priority.HIGH]),
                       assigned=(i,), since=now - (rng.uniform(60, 500) if young else rng.uniform(0, 2000)), attained=rng.choice([0.0, 900.0, 5e4, 2e5]),
                       run_s=1000.0, remaining_s=rng.uniform(1, 1e4)) for i in range(4)]
        waiting = [job(f"w{i}", rng.choice([Phase.PENDING, Phase.PAUSED]), prio=rng.choice(list(Priority)),
                       gpus=rng.choice([1, 2]), attained=rng.choice([0.0, 3e3, 5e4, 4e5]), run_s=rng.choice([0.0, 1e3, 1e5]),
                       since=now - rng.uniform(0, 5e3), submit=rng.uniform(0, now), remaining_s=rng.uniform(1, 1e4),
                       parked=None) for i in range(rng.choice([1, 5, 30]))]
        s = snap(now, gpus(2, nodes=2), running + waiting)
        for name in skipped:
            spec = SPECS[name]
            ctx = Ctx(s.now, s.config, s.costs, s.usage)
            cl = ClusterState(s)
            top = Preemption(s, spec, ctx, cl).max_level
            skipped[name] += top is not None and spec.none_below(cl.waiting, ctx, top)
            assert decide(s, name) == decide_explained(s, name)[0], (trial, name)
    assert all(skipped.values()) and not all(v == 60 for v in skipped.values()), skipped


def test_below_is_the_waiting_jobs_of_a_level_under_the_bound():
    """`Spec.below` gives exactly the jobs whose level is below the bound, in their order, for
    every policy that has one (gpuswap with and without class limits)."""
    from gpuswap.policy.classes import Limits

    rng = random.Random(17)
    now = 1e5
    for trial in range(40):
        jobs = [job(f"w{i}", rng.choice([Phase.PENDING, Phase.PAUSED]), prio=rng.choice(list(Priority)),
                    gpus=rng.choice([1, 2, 4]), attained=rng.choice([0.0, 3e3, 5e4, 4e5, rng.uniform(0, 1e6)]),
                    run_s=rng.choice([0.0, 1e3, 1e5]), since=now - rng.uniform(0, 5e4), submit=rng.uniform(0, now),
                    remaining_s=rng.uniform(1, 1e4)) for i in range(60)]
        lims = [None, Limits(base={"w1": 1}, lifted=frozenset({"w2", "w3"}), protected=frozenset({"w4"}),
                             floor_gpus=2, head=frozenset({"w5"}))]
        for name, spec in SPECS.items():
            if spec.below is None:
                continue
            for lim in lims if name == "gpuswap" else [None]:
                ctx = Ctx(now, PolicyConfig(), SwitchCosts(), {"u": 1e4}) if lim is None else \
                    Ctx(now, PolicyConfig(), SwitchCosts(), {"u": 1e4}, lim)
                levels = [spec.level(j, ctx) for j in jobs]
                for bound in set(levels):
                    assert spec.below(jobs, ctx, bound) == [j for j, lv in zip(jobs, levels) if lv < bound], \
                        (trial, name, bound)


def test_a_full_cluster_decides_as_the_whole_round_would_with_ram_parked_jobs():
    """On a full cluster the round orders only the jobs below the highest victim's level and the
    RAM-parked ones (`_Round._waiting`); `decide_explained` orders them all. Both decide alike,
    with pauses, spills of RAM-parked jobs and reservations among the decisions."""
    from gpuswap.policy import decide_explained

    rng = random.Random(23)
    paused = 0
    for trial in range(80):
        now = 1e5
        nodes, per = 3, 4
        running, g = [], 0
        while g < nodes * per:
            width = min(rng.choice([1, 1, 2, 4]), per - g % per)
            running.append(job(f"r{g}", Phase.RUNNING, prio=rng.choice([Priority.LOW, Priority.NORMAL, Priority.HIGH]),
                               gpus=width, assigned=tuple(range(g, g + width)), since=now - rng.uniform(0, 3000),
                               attained=rng.choice([0.0, 900.0, 5e4, 2e5]), run_s=1000.0,
                               remaining_s=rng.uniform(1, 1e4), mem_gib=rng.choice([4, 40]),
                               tiers=frozenset({"ram", "disk"})))
            g += width
        waiting = []
        for i in range(rng.choice([5, 30, 80])):
            ram = rng.random() < 0.3
            waiting.append(job(f"w{i}", Phase.PAUSED if ram or rng.random() < 0.3 else Phase.PENDING,
                               prio=rng.choice(list(Priority)), gpus=rng.choice([1, 1, 2, 4]),
                               attained=rng.choice([0.0, 3e3, 5e4, 4e5]), run_s=rng.choice([0.0, 1e3, 1e5]),
                               since=now - rng.uniform(0, 5e3), submit=rng.uniform(0, now),
                               remaining_s=rng.uniform(1, 1e4), mem_gib=rng.choice([4, 40]),
                               parked="ram" if ram else None, node=f"n{rng.randrange(nodes)}" if ram else None,
                               parked_bytes=int(40 * 1024**3) if ram else 0, tiers=frozenset({"ram", "disk"})))
        budget = {f"n{k}": rng.choice([100, 200, 400]) * 1024**3 for k in range(nodes)}
        s = snap(now, gpus(per, nodes=nodes), running + waiting, ram_budget=budget)
        for name, spec in SPECS.items():
            if spec.below is None:
                continue
            out = decide(s, name)
            assert out == decide_explained(s, name)[0], (trial, name)
            paused += any(isinstance(d, Pause) for d in out)
    assert paused > 20, paused
