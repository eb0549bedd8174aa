"""The common-step agreement, order by order (`runtime/agreement.py`, `runtime/rankcursor.py`).

Table-driven: each case is a script of inputs to the coordinator (or to one rank's cursor) and
the effects expected after each. test_agreement_model.py explores every interleaving of a small
job; these pin the exact messages of the orders that matter and the failure texts.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpuswap.protocol import records
from gpuswap.runtime import agreement as ag
from gpuswap.runtime import rankcursor as rc

T0 = 100.0
# What a report needs and these scripts leave out: the coordinator does not read it.
_FILLER = {"part": {"file": "ckpt-000001.r0.pt", "bytes": 0, "sha256": "0" * 64}, "committed": {"seq": 1, "path": "m"}}


def rep(msg: dict[str, Any]) -> records.Report:
    """A rank's report, written as its wire fields, as the record the coordinator receives (a key
    the record has not, like `run`'s epoch on a `done`, is left out as the gate leaves it out)."""
    cls = records.REPORTS[msg["op"]]
    known = {f.name for f in dataclasses.fields(cls)} - {"op"}
    return cls(**dict(_FILLER.get(msg["op"], {}), **{k: v for k, v in msg.items() if k in known}))


def wire(msgs: list[Any]) -> list[dict[str, Any]]:
    return [records.wire(m) for m in msgs]


def coordinator(world: int = 2, timeout_s: float = 30.0, **hello: Any) -> ag.Coordinator:
    c = ag.Coordinator(timeout_s)
    for r in range(world):
        assert c.hello(r, world, T0, pid=1000 + r, **hello) == []
    return c


def sends(effects: list[Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(rank, op, fields without op/epoch) of each Send, in order."""
    out = []
    for e in effects:
        assert isinstance(e, ag.Send), e
        fields = {k: v for k, v in records.wire(e.msg).items() if k not in ("op", "epoch")}
        out.append((e.rank, e.msg.op, fields))
    return out


def ops(effects: list[Any]) -> list[tuple[int, str]]:
    return [(r, op) for r, op, _ in sends(effects)]


def run(c: ag.Coordinator, script: list[tuple]) -> None:
    """Each step: (input, expected). input: ("want", run, tier) | ("msg", rank, op, fields) |
    ("lost", rank) | ("poll", seconds after T0). expected: a list of (rank, op) or (rank, op,
    fields-subset), or a Kill substring as ("kill", text)."""
    for n, (inp, expected) in enumerate(script):
        kind = inp[0]
        if kind == "want":
            eff = c.want(inp[1], inp[2], T0, **(inp[3] if len(inp) > 3 else {}))
        elif kind == "msg":
            msg = dict(inp[3], op=inp[2], epoch=inp[3].get("epoch", c.epoch))
            eff = c.receive(inp[1], rep(msg), T0)
        elif kind == "lost":
            eff = c.lost(inp[1], T0)
        elif kind == "poll":
            eff = c.poll(T0 + inp[1])
        else:
            raise AssertionError(kind)
        if expected and expected[0] == "kill":
            assert len(eff) == 1 and isinstance(eff[0], ag.Kill), (n, eff)
            assert expected[1] in eff[0].reason, (n, eff[0].reason)
            continue
        got = sends(eff)
        assert [(r, op) for r, op, _ in got] == [tuple(x[:2]) for x in expected], (n, inp, got)
        for (r, op, fields), want in zip(got, expected):
            if len(want) > 2:
                assert {k: fields.get(k) for k in want[2]} == want[2], (n, inp, fields)


BOTH = lambda op, **f: [(0, op, f), (1, op, f)] if f else [(0, op), (1, op)]  # noqa: E731


def agree(c: ag.Coordinator, seen: int = 5, tier: str = "ram") -> None:
    """Both ranks mark `seen` and reach target seen+1."""
    run(c, [(("want", "paused", tier), BOTH("pause", tier=tier)),
            (("msg", 0, "mark", {"seen": seen}), []),
            (("msg", 1, "mark", {"seen": seen}), BOTH("target", tick=seen + 1)),
            (("msg", 0, "ready", {"tick": seen + 1, "step": 41}), []),
            (("msg", 1, "ready", {"tick": seen + 1, "step": 41}), BOTH("park", tier=tier))])


# -- how the target is found -----------------------------------------------------------------------

@pytest.mark.parametrize("reports, target", [
    # (rank, op, tick) in arrival order -> the target every rank is sent
    ([(0, "mark", 5), (1, "mark", 5)], 6),          # both may still pass their next safepoint
    ([(0, "mark", 6), (1, "mark", 5)], 7),          # a rank one step ahead sets the target
    ([(0, "hold", 5), (1, "hold", 5)], 5),          # both already held: nobody needs to move
    ([(0, "hold", 5), (1, "mark", 5)], 6),          # rank 1 may have passed 5 before the flag
    ([(1, "hold", 6), (0, "mark", 5)], 6),          # the slow rank can still reach the fast one
    ([(0, "hold", 5), (0, "mark", 4), (1, "hold", 5)], 5),   # a mark after its own hold changes nothing
    ([(0, "mark", 0), (1, "mark", 0)], 1),          # a pause before the first safepoint
])
def test_target_is_the_first_tick_every_rank_can_still_reach(reports, target):
    c = coordinator()
    c.want("paused", "ram", T0)
    effects: list[Any] = []
    for rank, op, tick in reports:
        effects = c.receive(rank, rep({"op": op, "epoch": c.epoch, ("seen" if op == "mark" else "tick"): tick}), T0)
    assert sends(effects) == [(0, "target", {"tick": target}), (1, "target", {"tick": target})]
    assert c.facts()["target_tick"] == target


def test_no_target_until_every_rank_is_bounded():
    c = coordinator(world=3)
    c.want("paused", "ram", T0)
    assert c.receive(0, rep({"op": "hold", "epoch": 1, "tick": 9}), T0) == []
    assert c.receive(2, rep({"op": "mark", "epoch": 1, "seen": 9}), T0) == []
    assert ops(c.receive(1, rep({"op": "mark", "epoch": 1, "seen": 8}), T0)) == [(0, "target"), (1, "target"), (2, "target")]


# -- whole attempts --------------------------------------------------------------------------------

def test_ram_park_and_resume():
    c = coordinator()
    agree(c)
    run(c, [(("msg", 0, "paused", {"bytes": 10}), []),
            (("msg", 1, "paused", {"bytes": 32}), [])])
    f = c.facts()
    assert (c.phase, f["state"], f["tier"], f["bytes"], f["step"]) == (ag.PARKED, "paused", "ram", 42, 41)
    run(c, [(("want", "running", None), BOTH("resume")),
            (("msg", 1, "unparked", {}), []),
            (("msg", 0, "unparked", {}), BOTH("regroup", rebuild=True)),
            (("msg", 0, "resumed", {}), []),
            (("msg", 1, "resumed", {}), [])])
    assert c.phase == ag.RUNNING and c.facts()["state"] == "running" and c.error is None


def test_pause_and_resume_seconds_span_the_whole_move():
    # pause_s: from the pause request to every rank parked (the agreement included); resume_s:
    # from the resume request to every rank training again (unpark and regroup, not the regroup
    # alone).
    c = coordinator()
    c.want("paused", "ram", T0)
    for r in (0, 1):
        c.receive(r, rep({"op": "mark", "epoch": c.epoch, "seen": 5}), T0 + 1)
    for r in (0, 1):
        c.receive(r, rep({"op": "ready", "epoch": c.epoch, "tick": 6}), T0 + 2)
    for r in (0, 1):
        c.receive(r, rep({"op": "paused", "epoch": c.epoch, "bytes": 1}), T0 + 4)
    assert c.facts()["pause_s"] == 4
    c.want("running", None, T0 + 10)
    for r in (0, 1):
        c.receive(r, rep({"op": "unparked", "epoch": c.epoch}), T0 + 12)
    for r in (0, 1):
        c.receive(r, rep({"op": "resumed", "epoch": c.epoch}), T0 + 13)
    assert c.phase == ag.RUNNING and c.facts()["resume_s"] == 3


def test_disk_park_commits_every_part_then_every_rank_exits():
    c = coordinator()
    agree(c, tier="disk")
    run(c, [(("msg", 1, "part", {"file": "p1", "bytes": 5, "sha256": "b"}), []),
            (("msg", 0, "part", {"file": "p0", "bytes": 7, "sha256": "a"}), [(0, "commit")])])
    commit = c.attempt.answered if c.attempt else {}
    assert commit == {}   # a new phase starts with no answers
    run(c, [(("msg", 1, "committed", {"path": "x"}), []),          # only rank 0 commits
            (("msg", 0, "committed", {"path": "/ck/ckpt-3.json", "bytes": 12, "step": 40}), BOTH("exit"))])
    f = c.facts()
    assert (f["state"], f["ckpt_path"], f["bytes"]) == ("checkpointed", "/ck/ckpt-3.json", 12)
    assert f["step"] == 40                                   # the checkpoint's step, not a stale report
    assert c.lost(0, T0) == [] and c.lost(1, T0) == []     # exiting is what they were told to do
    assert c.poll(T0 + 1e6) == [] and c.phase == ag.CHECKPOINTED   # no deadline once committed


def test_a_rank_that_attaches_again_after_the_commit_does_not_undo_it():
    """torchrun restarting a worker that exited 75 races the supervisor: the new process's hello
    after the commit was read as a reconnect during the pause and killed the job, FAILED, with
    its checkpoint committed."""
    c = coordinator()
    agree(c, tier="disk")
    c.receive(0, rep({"op": "part", "epoch": 1}), T0)
    c.receive(1, rep({"op": "part", "epoch": 1}), T0)
    c.receive(0, rep({"op": "committed", "epoch": 1, "path": "m", "bytes": 3, "step": 9}), T0)
    assert c.lost(1, T0) == []
    assert c.hello(1, 2, T0 + 1, pid=999) == []
    assert c.phase == ag.CHECKPOINTED and c.facts()["state"] == "checkpointed"


def test_commit_lists_every_part_in_rank_order():
    c = coordinator()
    agree(c, tier="disk")
    c.receive(1, rep({"op": "part", "epoch": 1, "file": "p1", "bytes": 5, "sha256": "b"}), T0)
    (commit,) = c.receive(0, rep({"op": "part", "epoch": 1, "file": "p0", "bytes": 7, "sha256": "a"}), T0)
    assert records.wire(commit.msg)["parts"] == [{"file": "p0", "bytes": 7, "sha256": "a", "rank": 0},
                                   {"file": "p1", "bytes": 5, "sha256": "b", "rank": 1}]
    assert commit.msg.tick == 6


def test_spill_from_ram_to_disk():
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    run(c, [(("want", "paused", "disk"), BOTH("park", tier="disk")),
            (("msg", 0, "part", {"file": "a"}), []),
            (("msg", 1, "part", {"file": "b"}), [(0, "commit")])])


@pytest.mark.parametrize("why, setup, tier_reason", [
    ("a rank cannot rebuild its group", {"ram_refusal": "process subgroups of its own"}, "cannot rebuild"),
    ("the RAM budget is short", {}, "exceed the RAM budget"),
])
def test_ram_park_turns_into_disk_and_says_why(why, setup, tier_reason):
    c = coordinator(**setup)
    c.receive(0, rep({"op": "usage", "device_bytes": 600}), T0)
    c.receive(1, rep({"op": "usage", "device_bytes": 600}), T0)
    run(c, [(("want", "paused", "ram", {"max_bytes": 1000}), BOTH("pause")),
            (("msg", 0, "hold", {"tick": 3}), []),
            (("msg", 1, "hold", {"tick": 3}), BOTH("target")),
            (("msg", 0, "ready", {"tick": 3}), []),
            (("msg", 1, "ready", {"tick": 3}), BOTH("park", tier="disk"))])
    c.receive(0, rep({"op": "part", "epoch": 1}), T0)
    c.receive(1, rep({"op": "part", "epoch": 1}), T0)
    c.receive(0, rep({"op": "committed", "epoch": 1, "path": "m"}), T0)
    assert tier_reason in c.facts()["why_disk"]


# -- the pause is withdrawn: nothing was torn down, every rank trains on ----------------------------

@pytest.mark.parametrize("event, reason", [
    (("want", "running", None), None),                                   # the daemon changed its mind
    (("msg", 1, "done", {}), "rank 1 finished training"),                # a rank reached the end first
    (("lost", 1), "rank 1 exited or disconnected"),                     # a rank died mid-agreement
    (("poll", 31), "rank 1 (at tick 5) did not reach step 6 within 30 s"),   # a slow or hung rank
    (("msg", 1, "ready", {"tick": 7}), "rank 1 stopped at tick 7, not 6"),
    (("msg", 1, "error", {"message": "boom"}), "rank 1: boom"),
    (("msg", 1, "hold", {"tick": 8}), "rank 1 passed step 6"),
])
def test_agreement_withdrawn(event, reason):
    c = coordinator()
    run(c, [(("want", "paused", "ram"), BOTH("pause")),
            (("msg", 0, "mark", {"seen": 5}), []),
            (("msg", 1, "mark", {"seen": 5}), BOTH("target")),
            (("msg", 0, "ready", {"tick": 6}), [])])
    alive = [0] if event[0] == "lost" else [0, 1]
    run(c, [(event, [(r, "resume") for r in alive])])
    assert c.phase == ag.RUNNING and c.attempt is None
    assert (c.error is None) if reason is None else (reason in c.error), c.error


def test_deadline_before_any_target_names_the_silent_rank():
    c = coordinator()
    c.want("paused", "ram", T0)
    c.receive(0, rep({"op": "hold", "epoch": 1, "tick": 4}), T0)
    assert c.poll(T0 + 29) == []
    assert ops(c.poll(T0 + 31)) == [(0, "resume"), (1, "resume")]
    assert "rank 1 (at tick None) did not reach a safepoint within 30 s" in c.error


def test_stale_epochs_are_ignored_and_a_late_rank_is_released():
    c = coordinator()
    c.want("paused", "ram", T0)
    c.want("running", None, T0)        # withdrawn: epoch 1 is over
    assert c.receive(0, rep({"op": "hold", "epoch": 1, "tick": 3}), T0) == []
    c.want("paused", "ram", T0)        # epoch 2
    assert c.receive(0, rep({"op": "mark", "epoch": 1, "seen": 3}), T0) == []
    assert c.attempt is not None and c.attempt.bounds == {}
    # a rank that reconnects still waiting in epoch 1 is told to go on
    c2 = coordinator()
    c2.lost(1, T0)
    assert sends(c2.hello(1, 2, T0, pid=1001, epoch=1, state="holding")) == [(1, "resume", {})]


# -- after the groups were torn down: failures --------------------------------------------------------

def test_a_failed_ram_park_brings_every_rank_back():
    c = coordinator()
    agree(c)
    run(c, [(("msg", 0, "paused", {"bytes": 1}), []),
            (("msg", 1, "error", {"message": "out of pinned memory"}), BOTH("resume")),
            (("msg", 0, "unparked", {}), []),
            (("msg", 1, "unparked", {}), BOTH("regroup", rebuild=True)),
            (("msg", 0, "resumed", {}), []),
            (("msg", 1, "resumed", {}), [])])
    assert c.phase == ag.RUNNING
    assert c.error == "park failed, job keeps running: rank 1: out of pinned memory"


def test_a_failed_disk_park_from_running_needs_no_new_group():
    c = coordinator()
    agree(c, tier="disk")
    run(c, [(("msg", 0, "error", {"message": "disk full"}), BOTH("resume")),
            (("msg", 0, "unparked", {}), []),
            (("msg", 1, "unparked", {}), BOTH("regroup", rebuild=False))])


def test_a_failed_resume_leaves_the_job_parked():
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    run(c, [(("want", "running", None), BOTH("resume")),
            (("msg", 0, "unparked", {}), []),
            (("msg", 1, "error", {"message": "CUDA out of memory"}), BOTH("release"))])
    assert c.phase == ag.PARKED and c.facts()["state"] == "paused"
    assert "resume failed, job stays parked: rank 1: CUDA out of memory" == c.error


def test_a_job_parked_in_ram_has_no_deadline():
    # The pause timeout bounds the moves, not the park: a job parked longer than it was killed.
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    assert c.phase == ag.PARKED
    assert c.poll(T0 + 1e6) == [] and c.phase == ag.PARKED
    # The resume is a move again, bounded from when it was asked for.
    run(c, [(("want", "running", None), BOTH("resume"))])
    assert c.poll(T0 + 29) == []
    eff = c.poll(T0 + 31)
    assert len(eff) == 1 and isinstance(eff[0], ag.Kill) and "did not finish unparking" in eff[0].reason
    assert c.poll(T0 + 1e6) == []          # killed once: no second verdict with a phase "failed"


def test_a_disk_park_is_bounded_by_progress_not_by_its_length():
    # Writing the parts of a large job can take longer than the timeout: a rank whose write
    # moves (bytes written, in its usage reports) is waited for; one that stops moving is not.
    c = coordinator(timeout_s=30.0)
    agree(c, tier="disk")
    c.receive(1, rep({"op": "usage", "device_bytes": 0, "written": 100}), T0)   # before: no progress
    assert c.receive(0, rep({"op": "part", "epoch": 1}), T0 + 1) == []
    for t in range(10, 100, 10):          # rank 1 writes on, 90 s in all
        c.receive(1, rep({"op": "usage", "device_bytes": 0, "written": 100 + t}), T0 + t)
        assert c.poll(T0 + t + 25) == [], t
    assert c.phase == ag.PARKING
    eff = c.poll(T0 + 90 + 31)            # then it stops moving
    assert len(eff) == 1 and isinstance(eff[0], ag.Kill), eff
    assert "rank 1" in eff[0].reason and "rank 0" not in eff[0].reason, eff[0].reason
    assert c.lost(0, T0 + 200) == []     # the job is being ended already: no second verdict


@pytest.mark.parametrize("tier, wrong", [("ram", "part"), ("disk", "paused")])
def test_a_report_that_does_not_answer_the_park_is_ignored(tier, wrong):
    c = coordinator()
    agree(c, tier=tier)
    right = "paused" if tier == "ram" else "part"
    assert c.receive(0, rep({"op": right, "epoch": 1, "bytes": 1}), T0) == []
    assert c.receive(1, rep({"op": wrong, "epoch": 1, "bytes": 1}), T0) == []
    assert c.phase == ag.PARKING and c.ranks[1].state == "ready"
    eff = c.poll(T0 + 31)
    assert len(eff) == 1 and "rank 1 (at tick 6) did not finish parking" in eff[0].reason, eff


def test_a_failed_spill_leaves_the_job_parked_in_ram():
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    run(c, [(("want", "paused", "disk"), BOTH("park")),
            (("msg", 0, "part", {}), []),
            (("msg", 1, "error", {"message": "No space left on device"}), BOTH("release"))])
    assert c.phase == ag.PARKED and "spill to disk failed" in c.error


@pytest.mark.parametrize("phase_setup, event, text", [
    ("parked", ("lost", 1), "rank 1 exited or disconnected while the job was parked"),
    ("parking", ("lost", 0), "while the job was parking"),
    ("parking", ("poll", 31), "rank 1 (at tick 6) did not finish parking within 30 s"),
    ("regrouping", ("msg", 0, "error", {"message": "store timeout"}), "rank 0: store timeout while regrouping"),
    ("committing", ("lost", 0), "while the job was committing"),
])
def test_torn_down_jobs_that_cannot_go_on_are_killed_with_the_reason(phase_setup, event, text):
    c = coordinator()
    agree(c, tier="disk" if phase_setup == "committing" else "ram")
    if phase_setup == "parking":
        c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    elif phase_setup == "committing":
        c.receive(0, rep({"op": "part", "epoch": 1}), T0)
        c.receive(1, rep({"op": "part", "epoch": 1}), T0)
    else:
        c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
        c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
        if phase_setup == "regrouping":
            c.want("running", None, T0)
            c.receive(0, rep({"op": "unparked", "epoch": 1}), T0)
            c.receive(1, rep({"op": "unparked", "epoch": 1}), T0)
    run(c, [(event, ["kill", text])])
    assert c.phase == ag.FAILED and c.facts()["error"]


def test_a_rank_lost_after_its_part_is_durable_does_not_stop_the_commit():
    c = coordinator()
    agree(c, tier="disk")
    c.receive(0, rep({"op": "part", "epoch": 1}), T0)
    c.receive(1, rep({"op": "part", "epoch": 1}), T0)
    assert c.lost(1, T0) == []
    assert ops(c.receive(0, rep({"op": "committed", "epoch": 1, "path": "m"}), T0)) == [(0, "exit")]


def test_a_rank_that_regrouped_and_then_exits_does_not_kill_the_job():
    # rank 0 is in the new group and trains to the end before rank 1's `resumed` arrives
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.want("running", None, T0)
    c.receive(0, rep({"op": "unparked", "epoch": 1}), T0)
    c.receive(1, rep({"op": "unparked", "epoch": 1}), T0)
    c.receive(0, rep({"op": "resumed", "epoch": 1}), T0)
    assert c.lost(0, T0) == []
    assert c.receive(1, rep({"op": "resumed", "epoch": 1}), T0) == []
    assert c.phase == ag.RUNNING and c.error is None
    # before its own `resumed`, the same exit leaves its peer alone in a half-built group
    c = coordinator()
    agree(c)
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    c.want("running", None, T0)
    c.receive(0, rep({"op": "unparked", "epoch": 1}), T0)
    c.receive(1, rep({"op": "unparked", "epoch": 1}), T0)
    (kill,) = c.lost(0, T0)
    assert isinstance(kill, ag.Kill) and "while the job was regrouping" in kill.reason


def test_resume_asked_while_parking_waits_for_the_park_then_resumes():
    c = coordinator()
    agree(c)
    assert c.want("running", None, T0) == []
    c.receive(0, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)
    assert ops(c.receive(1, rep({"op": "paused", "epoch": 1, "bytes": 1}), T0)) == [(0, "resume"), (1, "resume")]


# -- who may pause ---------------------------------------------------------------------------------

def test_not_pausable_until_every_rank_attached():
    c = ag.Coordinator(30.0)
    assert c.pausable() == "no rank attached yet"
    c.hello(0, 4, T0, pid=1)
    c.hello(2, 4, T0, pid=3)
    assert c.pausable() == "2 of 4 ranks attached"
    assert c.want("paused", "ram", T0) == [] and c.phase == ag.RUNNING
    assert c.facts()["attached"] is False
    c.hello(1, 4, T0, pid=2)
    assert ops(c.hello(3, 4, T0, pid=4)) == [(0, "pause"), (1, "pause"), (2, "pause"), (3, "pause")]


def test_world_size_disagreement_and_duplicate_ranks_are_refused():
    c = coordinator()
    c.hello(1, 2, T0, pid=7777)                      # rank 1 is live under pid 1001: ignored
    assert c.ranks[1].pid == 1001
    c.hello(0, 3, T0, pid=1000)
    assert c.pausable() == "rank 0 says the world has 3 ranks, not 2"


def test_a_finished_rank_makes_the_job_unpausable():
    c = coordinator()
    c.receive(1, rep({"op": "done"}), T0)
    assert c.pausable() == "rank 1 finished training"
    assert c.want("paused", "ram", T0) == []


def test_show_lists_every_rank():
    c = coordinator()
    c.receive(0, rep({"op": "usage", "device_bytes": 5, "step": 3}), T0)
    ranks = c.facts()["ranks"]
    assert [(r["rank"], r["pid"], r["state"], r["device_bytes"]) for r in ranks] == [
        (0, 1000, "running", 5), (1, 1001, "running", 0)]


# -- one rank's cursor -----------------------------------------------------------------------------

def cursor_run(script: list[tuple]) -> rc.RankCursor:
    """Steps: ("msg", msg, seen) -> sends; ("sp", tick) -> (action, sends); ("wake",) -> (action,
    sends); ("done", action, ok, info) -> sends. Each with its expected result."""
    cur = rc.RankCursor()
    for n, (step, expected) in enumerate(script):
        if step[0] == "msg":
            order = records.order(step[1])      # the runtime's own decode of the wire
            assert order is not None, step
            got: Any = wire(cur.on_message(order, step[2]))
        elif step[0] == "sp":
            action, sends = cur.at_safepoint(step[1])
            got = (action, wire(sends))
        elif step[0] == "wake":
            action, sends = cur.wake()
            got = (action, wire(sends))
        else:
            got = wire(cur.finished(step[1], step[2], step[3] if len(step) > 3 else None))
        assert got == expected, (n, step, got)
    return cur


P = {"op": "pause", "epoch": 4, "tier": "ram"}
PART = {"file": "ckpt-000004.r0.pt", "bytes": 5, "sha256": "a" * 64, "seconds": 0.5}


def test_cursor_holds_then_trains_to_the_target():
    cur = cursor_run([
        (("msg", P, 7), [{"op": "mark", "epoch": 4, "seen": 7}]),
        (("sp", 8), ("wait", [{"op": "hold", "epoch": 4, "tick": 8}])),
        (("msg", {"op": "target", "epoch": 4, "tick": 9}, 8), []),
        (("wake",), ("continue", [])),
        (("sp", 9), ("wait", [{"op": "ready", "epoch": 4, "tick": 9}])),
        (("msg", {"op": "park", "epoch": 4, "tier": "ram"}, 9), []),
        (("wake",), ("park", [])),
        (("done", "park", True, {"bytes": 3}), [{"bytes": 3, "op": "paused", "epoch": 4, "tier": "ram"}]),
        (("msg", {"op": "resume", "epoch": 4}, 9), []),
        (("wake",), ("unpark", [])),
        (("done", "unpark", True), [{"op": "unparked", "epoch": 4}]),
        (("msg", {"op": "regroup", "epoch": 4, "rebuild": True}, 9), []),
        (("wake",), ("regroup", [])),
        (("done", "regroup", True, {"seconds": 1.5}), [{"seconds": 1.5, "op": "resumed", "epoch": 4}]),
    ])
    assert cur.phase == "running" and not cur.flagged


def test_cursor_target_known_before_its_flagged_safepoint():
    cursor_run([
        (("msg", P, 7), [{"op": "mark", "epoch": 4, "seen": 7}]),
        (("msg", {"op": "target", "epoch": 4, "tick": 9}, 7), []),
        (("sp", 8), ("continue", [])),
        (("sp", 9), ("wait", [{"op": "ready", "epoch": 4, "tick": 9}])),
    ])


def test_cursor_past_the_target_reports_and_trains_on():
    cur = cursor_run([
        (("msg", P, 7), [{"op": "mark", "epoch": 4, "seen": 7}]),
        (("msg", {"op": "target", "epoch": 4, "tick": 7}, 8), []),
        (("sp", 8), ("continue", [{"op": "error", "epoch": 4, "message": "passed the common step 7"}])),
    ])
    assert cur.phase == "running"


def test_cursor_withdrawn_while_holding_or_before_its_safepoint():
    cursor_run([
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("sp", 2), ("wait", [{"op": "hold", "epoch": 4, "tick": 2}])),
        (("msg", {"op": "resume", "epoch": 4}, 2), []),
        (("wake",), ("continue", [{"op": "resumed", "epoch": 4, "bytes": 0, "seconds": 0.0}])),
    ])
    cursor_run([
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("msg", {"op": "resume", "epoch": 4}, 1), []),
        (("sp", 2), ("continue", [{"op": "resumed", "epoch": 4, "bytes": 0, "seconds": 0.0}])),
    ])


def test_cursor_carries_out_park_then_resume_in_order():
    # the park failed on another rank: resume arrives before this rank even started its park
    cursor_run([
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("msg", {"op": "target", "epoch": 4, "tick": 2}, 1), []),
        (("sp", 2), ("wait", [{"op": "ready", "epoch": 4, "tick": 2}])),
        (("msg", {"op": "park", "epoch": 4, "tier": "ram"}, 2), []),
        (("msg", {"op": "resume", "epoch": 4}, 2), []),
        (("wake",), ("park", [])),
        (("done", "park", True, {"bytes": 1}), [{"bytes": 1, "op": "paused", "epoch": 4, "tier": "ram"}]),
        (("wake",), ("unpark", [])),
    ])


def test_cursor_spill_and_its_failure_elsewhere():
    cursor_run([
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("msg", {"op": "target", "epoch": 4, "tick": 2}, 1), []),
        (("sp", 2), ("wait", [{"op": "ready", "epoch": 4, "tick": 2}])),
        (("msg", {"op": "park", "epoch": 4, "tier": "ram"}, 2), []),
        (("wake",), ("park", [])),
        (("done", "park", True, {"bytes": 8}), [{"bytes": 8, "op": "paused", "epoch": 4, "tier": "ram"}]),
        (("msg", {"op": "park", "epoch": 4, "tier": "disk"}, 2), []),
        (("wake",), ("write", [])),
        (("done", "write", True, PART), [dict(PART, op="part", epoch=4)]),
        (("msg", {"op": "release", "epoch": 4}, 2), []),
        (("wake",), ("wait", [{"op": "paused", "epoch": 4, "bytes": 8}])),
    ])


def test_cursor_ignores_what_is_not_its_attempt():
    cur = cursor_run([
        (("msg", {"op": "target", "epoch": 3, "tick": 2}, 1), []),     # no attempt yet
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("msg", {"op": "park", "epoch": 3, "tier": "ram"}, 1), []),   # an old epoch
        (("sp", 2), ("wait", [{"op": "hold", "epoch": 4, "tick": 2}])),
        (("wake",), ("wait", [])),
    ])
    assert cur.queue == []


def test_cursor_failed_park_waits_for_resume():
    cursor_run([
        (("msg", P, 1), [{"op": "mark", "epoch": 4, "seen": 1}]),
        (("msg", {"op": "target", "epoch": 4, "tick": 2}, 1), []),
        (("sp", 2), ("wait", [{"op": "ready", "epoch": 4, "tick": 2}])),
        (("msg", {"op": "park", "epoch": 4, "tier": "disk"}, 2), []),
        (("wake",), ("write", [])),
        (("done", "write", False, {"message": "disk full"}), [{"op": "error", "epoch": 4, "message": "disk full"}]),
        (("msg", {"op": "resume", "epoch": 4}, 2), []),
        (("wake",), ("unpark", [])),
        (("done", "unpark", True), [{"op": "unparked", "epoch": 4}]),
        (("msg", {"op": "regroup", "epoch": 4, "rebuild": False}, 2), []),
        (("wake",), ("regroup", [])),
    ])
