"""A pool's nodes each move state at their own speed (Snapshot.node_costs, docs/ray.md): a job's
park, resume and spill are priced with its own node's costs, and a snapshot without them (one
machine, the simulator) is priced as before."""
from gpuswap.jobs import Priority
from gpuswap.policy import Pause, Phase, PolicyConfig, SwitchCosts, decide, decide_explained
from gpuswap.policy.costs import _TABLES, costs_of, costs_on, park_resume_s, switch_s
from gpuswap.policy.victims import protected_s, round_trip_s
from policy_helpers import GiB, gpus, job, snap

LOW, URGENT = Priority.LOW, Priority.URGENT
DISK = frozenset({"disk"})
SLOW_DISK = SwitchCosts(disk_write_bps=0.1e9, disk_read_bps=0.2e9)    # a tenth of the default's speed


def _holders():
    """Two like jobs, one on each node, that can only be parked to disk, and an urgent job."""
    common = dict(prio=LOW, tiers=DISK, mem_gib=8, since=0, attained=1e4, run_s=1e4)
    return [job("a", Phase.RUNNING, assigned=(0,), node="n0", **common),
            job("b", Phase.RUNNING, assigned=(1,), node="n1", **common),
            job("u", prio=URGENT, submit=99_990, since=99_990)]


def test_the_victim_is_the_one_whose_node_moves_it_cheaper():
    jobs, g = _holders(), gpus(1, nodes=2)
    same = decide(snap(100_000, g, jobs), "gpuswap")
    assert [(type(d), d.job_id) for d in same] == [(Pause, "a")]        # alike: the tie goes by id
    slow_n0 = decide(snap(100_000, g, jobs, node_costs={"n0": SLOW_DISK}), "gpuswap")
    assert [(type(d), d.job_id, d.tier) for d in slow_n0] == [(Pause, "b", "disk")]
    slow_n1 = decide(snap(100_000, g, jobs, node_costs={"n1": SLOW_DISK}), "gpuswap")
    assert [(type(d), d.job_id) for d in slow_n1] == [(Pause, "a")]
    # Every node's figures equal to the snapshot's: the same decision as without them.
    both = {"n0": SwitchCosts(), "n1": SwitchCosts()}
    assert decide(snap(100_000, g, jobs, node_costs=both), "gpuswap") == same


def test_protection_and_the_reasons_use_the_jobs_own_nodes_costs():
    a, b, _ = _holders()
    s = snap(100_000, gpus(1, nodes=2), [a, b], node_costs={"n0": SLOW_DISK},
             config=PolicyConfig(protect_cap_s=1e4))
    assert round_trip_s(a, s) == (switch_s(a, "disk", SLOW_DISK), "disk")
    assert round_trip_s(b, s) == (switch_s(b, "disk", SwitchCosts()), "disk")
    assert protected_s(a, s) == 4 * switch_s(a, "disk", SLOW_DISK) > protected_s(b, s)
    # A young job of 16 GiB: parking it to n1's slow disk would be over its switching cap, to a
    # disk of the default speed it would not. The urgent job waits, and its reason says so.
    young = dict(prio=LOW, tiers=DISK, mem_gib=16, submit=99_000, since=99_000, attained=900, run_s=900)
    b = job("b", Phase.RUNNING, assigned=(0,), node="n0", preemptible=False, **young)
    a = job("a", Phase.RUNNING, assigned=(1,), node="n1", **young)
    u = job("u", prio=URGENT, submit=99_990, since=99_990)
    decisions, waits = decide_explained(snap(100_000, gpus(1, nodes=2), [a, b, u], node_costs={"n1": SLOW_DISK}),
                                        "gpuswap")
    assert decisions == []
    [blocker] = [bl for bl in waits["u"].blockers if bl.job_id == "a"]
    assert blocker.code == "SwitchCap" and blocker.numbers["switch_s"] == switch_s(a, "disk", SLOW_DISK)
    decisions = decide(snap(100_000, gpus(1, nodes=2), [a, b, u]), "gpuswap")
    assert [(d.job_id, d.tier) for d in decisions] == [("a", "disk")]


def test_costs_on_falls_back_to_the_snapshots_costs():
    s = snap(0, gpus(1, nodes=2), [], node_costs={"n0": SLOW_DISK})
    assert costs_on(s, "n0") is SLOW_DISK
    assert costs_on(s, "n1") is s.costs and costs_on(s, None) is s.costs
    plain = snap(0, gpus(1), [])
    assert costs_on(plain, "n0") is plain.costs
    # A job's node: its GPUs' while it holds some (a view that does not name it: the simulator's),
    # else where its parked state is.
    assert costs_of(s, job("r", Phase.RUNNING, assigned=(0,))) is SLOW_DISK
    assert costs_of(s, job("r", Phase.RUNNING, assigned=(1,), node="n0")) is s.costs
    assert costs_of(s, job("p", Phase.PAUSED, parked="ram", node="n0")) is SLOW_DISK
    assert costs_of(s, job("q")) is s.costs


def test_alternating_node_costs_keep_each_their_round_trips():
    fast, slow = SwitchCosts(), SwitchCosts(disk_write_bps=0.1e9, disk_read_bps=0.2e9)
    want_fast = fast.park_s(GiB, "disk") + fast.resume_s(GiB, "disk")
    want_slow = slow.park_s(GiB, "disk") + slow.resume_s(GiB, "disk")
    for _ in range(3):
        assert park_resume_s(fast, GiB, "disk", 1) == want_fast
        assert park_resume_s(slow, GiB, "disk", 1) == want_slow
    assert _TABLES[id(fast)][0] is fast and _TABLES[id(slow)][0] is slow
    assert (GiB, 1, "disk") in _TABLES[id(fast)][1] and (GiB, 1, "disk") in _TABLES[id(slow)][1]
