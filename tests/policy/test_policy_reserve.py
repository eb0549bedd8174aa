"""No starvation of wide jobs (issue 15, item 2): a job that waited `reserve_after_s` gets a
reservation on the node that can free its GPUs soonest; jobs behind it no longer start, resume or
preempt there in a way that delays it, and backfill into GPUs it does not need still runs."""
import random
from dataclasses import replace

import pytest

from gpuswap.jobs import Priority
from gpuswap.policy import Pause, Phase, PolicyConfig, Start, decide, decide_explained
from policy_helpers import gpus, job, kinds, snap

LOW, NORMAL = Priority.LOW, Priority.NORMAL
BOUND = PolicyConfig().reserve_after_s


def _issue_case(waited: float, l1_ran: float = 2.0, now: float = 10_000.0):
    """The issue's case on one node of 2 GPUs: a 2-GPU normal job (W) waits; GPU 1 is held by a
    low job started `l1_ran` s ago (protected while younger than the 5 s floor of its protection); GPU 0 is
    free; a later 1-GPU low job (L2) waits behind W."""
    l1 = job("L1", Phase.RUNNING, prio=LOW, assigned=(1,), submit=now - l1_ran, since=now - l1_ran)
    w = job("W", prio=NORMAL, gpus=2, submit=now - waited, since=now - waited)
    l2 = job("L2", prio=LOW, submit=now - 1, since=now - 1)
    return snap(now, gpus(2), [l1, w, l2])


@pytest.mark.parametrize("waited, l1_ran, expected", [
    # Before the bound: backfill with no reservation -- L2 takes the GPU W needs (the starvation).
    (BOUND - 1, 2.0, [("Start", "L2")]),
    # Past the bound: GPU 0 is held for W, L2 waits; L1 is still protected, so nothing moves.
    (BOUND + 1, 2.0, []),
    # Past the bound, L1's protection over: W pauses L1 (same rules as any preemption) and L2 waits.
    (BOUND + 1, 100.0, [("Pause", "L1")]),
])
def test_issue_case_starves_before_the_bound_and_gets_its_gpus_after(waited, l1_ran, expected):
    s = _issue_case(waited, l1_ran)
    out = decide(s)
    assert kinds(out) == expected
    assert decide_explained(s)[0] == out


def test_the_old_rule_without_a_bound_keeps_starting_the_narrow_job():
    """reserve_after_s=None is the engine before item 2: L2 is started into W's GPU however long W waited."""
    s = _issue_case(100 * BOUND)
    assert kinds(decide(replace(s, config=PolicyConfig(reserve_after_s=None)))) == [("Start", "L2")]
    assert kinds(decide(s)) == []


def test_the_reservation_is_explained_both_ways():
    out, waits = decide_explained(_issue_case(BOUND + 1))
    assert out == []
    w = waits["W"]
    assert w.code == "Reserved"
    assert "holds a reservation on n0" in w.text and "GPU 0 held for it" in w.text, w.text
    assert w.numbers["gpus_held"] == 1 and w.numbers["gpus_missing"] == 1
    l2 = waits["L2"]
    assert l2.code == "Reserved"
    assert "GPU 0 reserved for job W" in l2.text, l2.text


def test_backfill_that_does_not_delay_it_still_runs():
    """Two nodes with one free GPU each: n0's other GPU is a low job W may pause once protected no
    more; n1's is a normal job it may never pause. W reserves n0 (sooner); L2 backfills on n1."""
    now = 10_000.0
    jobs = [job("L1", Phase.RUNNING, prio=LOW, assigned=(1,), submit=now - 2, since=now - 2),
            job("N1", Phase.RUNNING, prio=NORMAL, assigned=(3,), submit=0, since=0),
            job("W", prio=NORMAL, gpus=2, submit=now - BOUND - 1, since=now - BOUND - 1),
            job("L2", prio=LOW, submit=now - 1, since=now - 1)]
    out, waits = decide_explained(snap(now, gpus(2, nodes=2), jobs))
    assert out == [Start("L2", (2,), "started on n1 GPU 2")]
    assert "holds a reservation on n0" in waits["W"].text
    # Before the bound, best fit (fewest free, then the node name) sent L2 to n0, into W's GPU.
    early = [replace(j, submit_time=now - 5, phase_since=now - 5) if j.id == "W" else j for j in jobs]
    assert decide(snap(now, gpus(2, nodes=2), early)) == [Start("L2", (0,), "started on n0 GPU 0")]


def test_jobs_behind_it_do_not_preempt_on_the_reserved_node():
    """W (2 GPUs) cannot pause both low jobs yet (L3 protected); X, a later 1-GPU normal job, could
    pause L1. Past the bound the node is W's: X waits, and L1 is left for W."""
    now = 10_000.0

    def jobs(w_since):
        return [job("L1", Phase.RUNNING, prio=LOW, assigned=(0,), submit=0, since=now - 100),
                job("L3", Phase.RUNNING, prio=LOW, assigned=(1,), submit=now - 2, since=now - 2),
                job("W", prio=NORMAL, gpus=2, submit=w_since, since=w_since),
                job("X", prio=NORMAL, submit=now - 1, since=now - 1)]
    assert kinds(decide(snap(now, gpus(2), jobs(now - 5)))) == [("Pause", "L1")]     # for X
    out, waits = decide_explained(snap(now, gpus(2), jobs(now - BOUND - 1)))
    assert out == []
    assert waits["X"].code == "Reserved" and "kept for job W, which holds a reservation on n0" in waits["X"].text, waits["X"].text
    # Once L3's protection ends too, W pauses both.
    later = snap(now + 60, gpus(2), jobs(now - BOUND - 1))
    assert sorted(kinds(decide(later))) == [("Pause", "L1"), ("Pause", "L3")]


def test_jobs_ahead_of_it_are_not_held_back():
    """A reservation binds only the jobs behind it in the order: an urgent job arriving later is
    ahead of W and takes the free GPU."""
    s = _issue_case(BOUND + 1)
    urgent = job("U", prio=Priority.URGENT, submit=s.now, since=s.now)
    assert kinds(decide(replace(s, jobs=s.jobs + (urgent,)))) == [("Start", "U")]


def test_one_reservation_per_node_and_ties_by_node_name():
    """Two starving wide jobs on two identical nodes: the first in the order reserves n0 (tie by
    name), the second n1; a narrow job behind both gets nothing; the answer does not depend on the
    order jobs come in the snapshot."""
    now = 10_000.0
    jobs = [job("A", Phase.RUNNING, prio=LOW, assigned=(1,), submit=now - 2, since=now - 2),
            job("B", Phase.RUNNING, prio=LOW, assigned=(3,), submit=now - 2, since=now - 2),
            job("W1", prio=NORMAL, gpus=2, submit=now - 2000, since=now - 2000),
            job("W2", prio=NORMAL, gpus=2, submit=now - 1900, since=now - 1900),
            job("L", prio=LOW, submit=now - 1, since=now - 1)]
    outs = set()
    for seed in range(6):
        shuffled = list(jobs)
        random.Random(seed).shuffle(shuffled)
        out, waits = decide_explained(snap(now, gpus(2, nodes=2), shuffled))
        outs.add(tuple(out))
        assert "reservation on n0" in waits["W1"].text and "reservation on n1" in waits["W2"].text
        assert waits["L"].code == "Reserved"
    assert outs == {()}


@pytest.mark.parametrize("policy", ["fifo", "priority", "las", "gandiva"])
def test_other_policies_do_not_reserve(policy):
    """They reproduce published schemes without reservations: unchanged, however long W waited."""
    s = _issue_case(100 * BOUND)
    assert [k for k in kinds(decide(s, policy)) if k[0] == "Start"] == [("Start", "L2")]


def test_the_wide_job_gets_its_gpus_over_a_stream_of_narrow_jobs():
    """Steps of the issue's scenario: every 40 s a 1-GPU low job ends and a new one arrives. With
    reservations W runs once it has waited past the bound; without, never within the hour. Each low
    job is protected a fixed 60 s (the rule before cost-aware protection, `protect_multiple=0`), so W
    can never pause one: the narrow jobs keep taking the GPU that frees."""
    fixed = dict(min_runtime_s=60.0, protect_multiple=0.0)
    def run(config):
        now, running, n = 0.0, {0: ("La", -20.0), 1: ("Lb", 0.0)}, 0
        w = job("W", prio=NORMAL, gpus=2, submit=0, since=0)
        for step in range(90):
            now = 40.0 * (step + 1)
            # the oldest low job ends; a new one waits
            oldest = min(running, key=lambda g: running[g][1])
            del running[oldest]
            n += 1
            jobs = [job(i, Phase.RUNNING, prio=LOW, assigned=(g,), submit=t, since=t) for g, (i, t) in running.items()]
            jobs += [w, job(f"L{n}", prio=LOW, submit=now, since=now)]
            out = decide(snap(now, gpus(2), jobs, config=config))
            for d in out:
                if isinstance(d, Start) and d.job_id == "W":
                    return now
                if isinstance(d, Start):
                    running[d.gpus[0]] = (d.job_id, now)
                if isinstance(d, Pause):            # parked at once, for the test's purpose
                    running = {g: v for g, v in running.items() if v[0] != d.job_id}
        return None

    assert run(PolicyConfig(reserve_after_s=None, **fixed)) is None
    started = run(PolicyConfig(**fixed))
    assert started is not None and BOUND <= started <= BOUND + 200


def test_decide_and_decide_explained_agree_with_reservations():
    """Random small clusters with reservations forming (bound 0 or 200 s), RAM-parked jobs pinned
    to their GPUs among them: the explained round makes the same decisions, every waiting job
    not served has a reason, and shuffling the snapshot changes nothing."""
    rng = random.Random(15)
    for trial in range(300):
        n_gpu = rng.choice([2, 4])
        nodes = rng.choice([1, 2, 3])
        g = gpus(n_gpu, nodes=nodes)
        free = [x.id for x in g]
        rng.shuffle(free)
        jobs = []
        for i in range(rng.randint(2, 9)):
            want = rng.choice([1, 1, 2, 4])
            prio = rng.choice([LOW, NORMAL, Priority.HIGH])
            kind = rng.choice(["run", "run", "pend", "pend", "disk", "pinned"])
            node_ids = [x for x in free if x // n_gpu == (free[0] // n_gpu if free else 0)][:want]
            if kind in ("run", "pinned") and len(node_ids) == want:
                for x in node_ids:
                    free.remove(x)
                if kind == "run":
                    jobs.append(job(str(i), Phase.RUNNING, prio=prio, gpus=want, assigned=tuple(node_ids),
                                    since=rng.uniform(0, 590), attained=rng.uniform(0, 1e5),
                                    preemptible=rng.random() > 0.2))
                else:                       # its GPUs are free: it waits for exactly them
                    jobs.append(job(str(i), Phase.PAUSED, prio=prio, gpus=want, parked="ram", node=f"n{node_ids[0] // n_gpu}",
                                    home_gpus=tuple(sorted(node_ids)), since=rng.uniform(0, 590),
                                    run_s=rng.uniform(1, 300), attained=rng.uniform(0, 1e5)))
            elif kind == "disk":
                jobs.append(job(str(i), Phase.PAUSED, prio=prio, gpus=want, parked="disk", since=rng.uniform(0, 590),
                                run_s=rng.uniform(1, 300), attained=rng.uniform(0, 1e5)))
            else:
                jobs.append(job(str(i), prio=prio, gpus=want, submit=rng.uniform(0, 590), since=rng.uniform(0, 590)))
        config = PolicyConfig(min_runtime_s=rng.choice([0, 60, 600]), reserve_after_s=rng.choice([0.0, 200.0, None]))
        s = snap(600, g, jobs, config=config)
        out, waits = decide_explained(s)
        assert out == decide(s), trial
        served = {d.job_id for d in out if type(d).__name__ in ("Start", "Resume")}
        waiting = {j.id for j in s.jobs if j.phase in (Phase.PENDING, Phase.PAUSED)}
        assert set(waits) == waiting - served, (trial, waits, out)
        shuffled = list(jobs)
        rng.shuffle(shuffled)
        assert decide(replace(s, jobs=tuple(shuffled))) == out, trial


def test_nothing_changes_while_no_job_has_waited_past_the_bound():
    """The same random snapshots as above, every job in its phase for less than the bound: the
    decisions (and reasons) are those of the engine without reservations."""
    rng = random.Random(16)
    for trial in range(200):
        g = gpus(rng.choice([2, 4]), nodes=rng.choice([1, 2]))
        free = [x.id for x in g]
        rng.shuffle(free)
        jobs = []
        for i in range(rng.randint(2, 9)):
            want = rng.choice([1, 2, 2, 4])
            prio = rng.choice([LOW, NORMAL, Priority.HIGH])
            if rng.random() < 0.5 and len(free) >= want:
                taken, free = tuple(free[:want]), free[want:]
                jobs.append(job(str(i), Phase.RUNNING, prio=prio, gpus=1, assigned=taken[:1],
                                since=rng.uniform(0, 590), attained=rng.uniform(0, 1e5)))
                free = list(taken[1:]) + free
            else:
                jobs.append(job(str(i), prio=prio, gpus=want, submit=rng.uniform(1, 590), since=rng.uniform(1, 590)))
        s = snap(600, g, jobs, config=PolicyConfig(min_runtime_s=rng.choice([0, 60]), reserve_after_s=600.0))
        off = replace(s, config=replace(s.config, reserve_after_s=None))
        assert decide(s) == decide(off), trial
        assert decide_explained(s) == decide_explained(off), trial


def test_no_reservation_where_every_holder_ranks_ahead():
    """W (2 GPUs, low) cannot get GPU 1: its holder is a normal job, ahead of W in the order, that
    W may never pause. A reservation there would only idle GPU 0 while W waits its turn, so W takes
    none and L2, a later low job, backfills into GPU 0 (the first version of the rule held GPU 0
    idle for W: on Philly such reservations cost 24% of the average JCT)."""
    now = 10_000.0
    jobs = [job("H", Phase.RUNNING, prio=NORMAL, assigned=(1,), submit=now - 100, since=now - 100),
            job("W", prio=LOW, gpus=2, submit=now - BOUND - 1, since=now - BOUND - 1),
            job("L2", prio=LOW, submit=now - 1, since=now - 1)]
    out, waits = decide_explained(snap(now, gpus(2), jobs))
    assert kinds(out) == [("Start", "L2")]
    assert waits["W"].code != "Reserved", waits["W"]


def test_a_holder_that_ranks_behind_and_may_not_be_paused_still_gets_a_reservation():
    """W (2 GPUs, normal) cannot pause L1 (low, not preemptible), but L1 ranks behind W and ends in
    time: W reserves the node, and L2, a later low job, may not take GPU 0 meanwhile."""
    now = 10_000.0
    jobs = [job("L1", Phase.RUNNING, prio=LOW, assigned=(1,), submit=now - 100, since=now - 100,
                preemptible=False),
            job("W", prio=NORMAL, gpus=2, submit=now - BOUND - 1, since=now - BOUND - 1),
            job("L2", prio=LOW, submit=now - 1, since=now - 1)]
    out, waits = decide_explained(snap(now, gpus(2), jobs))
    assert out == []
    assert waits["W"].code == "Reserved" and waits["L2"].code == "Reserved", (waits["W"], waits["L2"])


def test_what_a_round_remembers_of_each_node_changes_no_decision(monkeypatch):
    """A round remembers, per node, that it found no reservation for a job of n GPUs (and asks no
    later job of n or more there) and which holders a level may pause (reservation.py: every input
    only shrinks along the round), it rules a node out by its holders' levels alone where even
    all those of a level that could count would not free enough, and it asks whether the holders
    behind a job could cover its need before how soon a node frees (`Reservations._choose`). Random full clusters of several nodes with many wide jobs past
    the bound, pending or parked in RAM on their node, at mixed classes, services and protections:
    the decisions and every reason are those of a round that asks every node every time."""
    from gpuswap.policy.reservation import Reservations

    rng = random.Random(25)
    reserved = refused = 0
    for trial in range(250):
        n_gpu, n_nodes = rng.choice([4, 8]), rng.choice([3, 5, 8])
        g = gpus(n_gpu, nodes=n_nodes)
        jobs, k = [], 0
        for node in range(n_nodes):
            ids = [node * n_gpu + i for i in range(n_gpu)]
            rng.shuffle(ids)
            while ids:                       # the node is full of running jobs of 1-4 GPUs
                want = min(rng.choice([1, 1, 2, 4]), len(ids))
                held, ids = tuple(ids[:want]), ids[want:]
                since = rng.uniform(0, 1990)
                jobs.append(job(f"r{k}", Phase.RUNNING, prio=rng.choice([LOW, NORMAL, Priority.HIGH]),
                                user=rng.choice("abc"), gpus=want, assigned=held, since=since,
                                attained=rng.uniform(0, 1e5), preemptible=rng.random() > 0.15))
                k += 1
        for i in range(rng.randint(5, 40)):
            want = rng.choice([1, 2, 2, 4, 4, n_gpu])
            prio, user = rng.choice([LOW, NORMAL, Priority.HIGH]), rng.choice("abc")
            since = rng.uniform(0, 1990)
            if rng.random() < 0.4:          # parked in RAM: it may resume only on its own node
                jobs.append(job(f"w{i}", Phase.PAUSED, prio=prio, user=user, gpus=want, parked="ram",
                                node=f"n{rng.randrange(n_nodes)}", since=since, run_s=rng.uniform(1, 5000),
                                attained=rng.uniform(0, 1e5), submit=rng.uniform(0, since)))
            else:
                jobs.append(job(f"w{i}", prio=prio, user=user, gpus=want, submit=since, since=since))
        s = snap(2000, g, jobs, config=PolicyConfig(min_runtime_s=rng.choice([0, 60, 600]),
                                                    reserve_after_s=rng.choice([0.0, 300.0])))
        monkeypatch.setattr(Reservations, "remember", True)
        kept = decide(s), decide_explained(s)
        monkeypatch.setattr(Reservations, "remember", False)
        assert (decide(s), decide_explained(s)) == kept, trial
        waits = kept[1][1]
        reserved += sum(w.code == "Reserved" for w in waits.values())
        refused += sum(j.gpus >= 2 and j.id in waits and waits[j.id].code != "Reserved" for j in s.jobs)
    assert reserved > 100 and refused > 1000, (reserved, refused)   # both kinds of answer were checked
