"""Every interleaving of a small multi-rank job against the agreement (`runtime/agreement.py` and
`runtime/rankcursor.py`), explored exhaustively: no processes, no sockets, no clock.

The model: W ranks train L steps; step k holds one collective that a rank can leave only once
every rank has entered it (DDP's gradient all-reduce). A safepoint is two moves of the training
thread, "store the tick" then "test the flag", and a `pause` delivery is one move of the reader
thread ("set the flag, read the tick"), so every order of the race the protocol relies on is
tried. Messages travel in FIFO channels, one per direction per rank, delivered in any order
across ranks. The daemon's requests (pause, withdraw, resume, spill) and the pause deadline are
moves too, allowed at any moment they make sense.

Checked in every reachable state: no rank tears its group down (park) or writes its part unless
every rank stands at the same target tick outside any collective; no rank passes the target while
an attempt is on; no deadlock (a state with no move must be a proper end); and, where nothing
fails, nobody is killed. The explorer also counts what it saw, so a test cannot pass vacuously.
"""
from __future__ import annotations

import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest

from gpuswap.protocol import records
from gpuswap.runtime import agreement as ag
from gpuswap.runtime import rankcursor as rc

LOST = {"op": "<connection closed>"}


@dataclass
class Cfg:
    world: int = 2
    steps: int = 3
    tier: str = "ram"
    withdraw: bool = False        # the daemon may withdraw the pause at any moment of the agreement
    resume: bool = True           # once parked, the daemon resumes the job
    spill: bool = False           # once parked in RAM, the daemon asks for disk
    deadline: bool = False        # the pause timeout may fire at any moment of an attempt
    done_msg: bool = True         # a rank says `done` when its loop ends (framework callbacks)
    final_barrier: bool = False   # the script ends with a collective (a barrier) before exiting
    fail: Optional[tuple[int, str]] = None   # (rank, action) that fails once
    ask_at_start: bool = False    # the pause is asked before the first step (a smaller space)
    eager_up: bool = False        # a rank's messages reach the coordinator at once (a smaller
                                  # space: the coordinator never learns late; used for 3 ranks)


@dataclass
class Rank:
    tick: int = 0
    stage: str = "pre"            # pre | in | post | stored | wait | act | barrier | exited
    action: Optional[str] = None
    cursor: rc.RankCursor = field(default_factory=rc.RankCursor)


@dataclass
class World:
    coord: ag.Coordinator
    ranks: list[Rank]
    down: list[list] = field(default_factory=list)     # coordinator -> rank (FIFO: lists, which
    up: list[list] = field(default_factory=list)       # pickle several times faster than deques)
    asked: bool = False
    withdrawn: bool = False
    resumes: int = 0              # how many times the daemon asked to resume
    spilled: bool = False
    failed_once: bool = False
    killed: Optional[str] = None
    regrouped: frozenset = frozenset()


def canon(w: World) -> bytes:
    """A state's identity. Equal states that differ only in a dict's insertion order count twice,
    which costs time, never soundness."""
    return pickle.dumps(w, pickle.HIGHEST_PROTOCOL)


def start(cfg: Cfg) -> World:
    w = World(ag.Coordinator(timeout_s=10.0), [Rank() for _ in range(cfg.world)])
    w.down = [[] for _ in range(cfg.world)]
    w.up = [[] for _ in range(cfg.world)]
    for r in range(cfg.world):
        w.coord.hello(r, cfg.world, 0.0, pid=100 + r)
    if cfg.ask_at_start:
        w.asked = True
        apply(w, w.coord.want("paused", cfg.tier, 0.0))
    return w


def apply(w: World, effects: list[Any]) -> None:
    for e in effects:
        if isinstance(e, ag.Kill):
            w.killed = e.reason
        else:
            w.down[e.rank].append(e.msg)


def target(w: World) -> Optional[int]:
    a = w.coord.attempt
    return a.target if a is not None else None


class Violation(AssertionError):
    pass


def moves(w: World, cfg: Cfg, stats: dict[str, int], blob: Optional[bytes] = None) -> list[World]:
    """Every world one move away. `blob` is `canon(w)` when the caller has it: each branch starts
    from a copy made by unpickling it (pickling dominates the exploration's time)."""
    out: list[World] = []
    if w.killed:
        return out
    if blob is None:
        blob = canon(w)

    def branch(fn: Any) -> None:
        nw = pickle.loads(blob)
        if fn(nw) is not False:
            if cfg.eager_up:
                for j in range(len(nw.up)):
                    while nw.up[j] and not nw.killed:
                        deliver_up(nw, j)
            out.append(nw)

    c = w.coord
    # the daemon and the clock
    if not w.asked:
        branch(lambda nw: (setattr(nw, "asked", True), apply(nw, nw.coord.want("paused", cfg.tier, 0.0))))
    if cfg.withdraw and not w.withdrawn and c.phase == ag.AGREEING:
        branch(lambda nw: (setattr(nw, "withdrawn", True), apply(nw, nw.coord.want("running", None, 0.0))))
    if cfg.spill and not w.spilled and c.phase == ag.PARKED:
        branch(lambda nw: (setattr(nw, "spilled", True), apply(nw, nw.coord.want("paused", "disk", 0.0))))
    # A resume that failed leaves the job parked; the daemon asks again (once, in the model).
    tries = 2 if cfg.fail is not None and cfg.fail[1] == rc.UNPARK else 1
    if cfg.resume and w.resumes < tries and c.phase == ag.PARKED and (not cfg.spill or w.spilled):
        branch(lambda nw: (setattr(nw, "resumes", nw.resumes + 1), apply(nw, nw.coord.want("running", None, 0.0))))
    if cfg.deadline and c.attempt is not None:
        branch(lambda nw: apply(nw, nw.coord.poll(1e9)))
    for i, r in enumerate(w.ranks):
        if w.up[i]:
            branch(lambda nw, i=i: deliver_up(nw, i))
        if w.down[i]:
            branch(lambda nw, i=i: deliver_down(nw, i))
        branch_rank = train_move(w, i, cfg)
        if branch_rank is not None:
            branch(lambda nw, i=i, f=branch_rank: f(nw, i, cfg, stats))
    return out


def deliver_up(w: World, i: int) -> None:
    msg = w.up[i].pop(0)
    apply(w, w.coord.lost(i, 0.0) if msg is LOST or msg == LOST else w.coord.receive(i, msg, 0.0))


def deliver_down(w: World, i: int) -> None:
    msg = w.down[i].pop(0)
    r = w.ranks[i]
    if r.stage == "exited":
        return
    # the reader thread: set the flag, then read the tick (the training thread's last store)
    w.up[i].extend(r.cursor.on_message(msg, seen=r.tick))


def all_entered(w: World, k: int) -> bool:
    return all(q.tick >= k or (q.tick == k - 1 and q.stage in ("in", "post")) for q in w.ranks)


def next_step(w: World, i: int, cfg: Cfg) -> None:
    r = w.ranks[i]
    if r.tick < cfg.steps:
        r.stage = "pre"
        return
    if cfg.done_msg:
        w.up[i].append(records.Done())
    if cfg.final_barrier:
        r.stage = "barrier"
    else:
        exit_rank(w, i)


def exit_rank(w: World, i: int) -> None:
    w.ranks[i].stage = "exited"
    w.up[i].append(LOST)


def train_move(w: World, i: int, cfg: Cfg) -> Any:
    r = w.ranks[i]
    s = r.stage
    if s == "pre":
        return lambda nw, i, cfg, st: setattr(nw.ranks[i], "stage", "in")
    if s == "in":
        if not all_entered(w, r.tick + 1):
            return None
        return lambda nw, i, cfg, st: setattr(nw.ranks[i], "stage", "post")
    if s == "post":
        def store(nw: World, i: int, cfg: Cfg, st: dict) -> None:
            nw.ranks[i].tick += 1
            nw.ranks[i].stage = "stored"
        return store
    if s == "stored":
        return flag_test
    if s == "wait":
        cur = r.cursor
        if not cur.queue and not (cur.phase == "holding" and cur.target is not None):
            return None
        return wake
    if s == "act":
        return act
    if s == "barrier":
        if not all(q.stage in ("barrier", "exited") for q in w.ranks):
            return None
        return lambda nw, i, cfg, st: exit_rank(nw, i)
    return None


def follow(w: World, i: int, cfg: Cfg, action: str, msgs: list, st: dict) -> None:
    r = w.ranks[i]
    w.up[i].extend(msgs)
    if action == rc.CONTINUE:
        next_step(w, i, cfg)
    elif action == rc.WAIT:
        r.stage = "wait"
    else:
        r.stage, r.action = "act", action


def flag_test(w: World, i: int, cfg: Cfg, st: dict) -> None:
    r = w.ranks[i]
    if not r.cursor.flagged:
        next_step(w, i, cfg)
        return
    action, msgs = r.cursor.at_safepoint(r.tick)
    follow(w, i, cfg, action, msgs, st)


def wake(w: World, i: int, cfg: Cfg, st: dict) -> None:
    action, msgs = w.ranks[i].cursor.wake()
    follow(w, i, cfg, action, msgs, st)


def act(w: World, i: int, cfg: Cfg, st: dict) -> Any:
    r = w.ranks[i]
    a = r.action
    if a in (rc.PARK, rc.WRITE):
        t = target(w)
        if t is None or any(q.stage not in ("wait", "act", "exited") or q.tick != t for q in w.ranks):
            raise Violation(f"rank {i} {a}s while ranks are at {[(q.stage, q.tick) for q in w.ranks]}, target {t}")
        st[a] = st.get(a, 0) + 1
    if a == rc.REGROUP:
        # init_process_group returns only once every rank has joined the new group
        epoch = r.cursor.epoch
        here = {j for j, q in enumerate(w.ranks) if q.stage == "act" and q.action == rc.REGROUP}
        if not r.cursor.rebuild:
            pass
        elif len(here | {j for (e, j) in w.regrouped if e == epoch}) < len(w.ranks):
            return False
        w.regrouped = w.regrouped | {(epoch, i)}
        st["regroup"] = st.get("regroup", 0) + 1
    if a == rc.EXIT:
        st["exit"] = st.get("exit", 0) + 1
        exit_rank(w, i)
        return None
    ok = not (cfg.fail == (i, a) and not w.failed_once)
    if not ok:
        w.failed_once = True
    info = {"bytes": 10, "seconds": 0.0}
    if a == rc.WRITE:
        info.update(file=f"part{i}", sha256="x")
    if a == rc.COMMIT:
        info = {"bytes": 10, "seq": 1, "path": "manifest"}
    msgs = r.cursor.finished(a, ok, info)
    w.up[i].extend(msgs)
    if a == rc.REGROUP and ok:
        next_step(w, i, cfg)
    else:
        r.stage, r.action = "wait", None
    return None


def check(w: World, cfg: Cfg) -> None:
    t = target(w)
    if t is not None and w.coord.phase == ag.AGREEING:
        for i, r in enumerate(w.ranks):
            if r.tick > t and r.cursor.epoch == w.coord.attempt.epoch and r.cursor.phase != "running":
                raise Violation(f"rank {i} at tick {r.tick} passed the target {t}")


def proper_end(w: World, cfg: Cfg) -> bool:
    if w.killed:
        return True
    if all(r.stage == "exited" for r in w.ranks) and not any(w.up) and not any(w.down):
        return True
    parked = w.coord.phase == ag.PARKED and all(r.stage == "wait" for r in w.ranks)
    return parked and not any(w.up) and not any(w.down) and not cfg.resume


def explore(cfg: Cfg, limit: int = 400_000) -> tuple[dict[str, int], list[World]]:
    w0 = start(cfg)
    first = canon(w0)
    seen = {first}
    # Each state is queued with its pickle (one dump per state found, which is also its identity
    # in `seen`): its branches unpickle copies of it, and the state itself is the world that was
    # pickled, never unpickled again (a quarter of the loads).
    todo = deque([(first, w0)])
    stats: dict[str, int] = {"states": 0}
    ends: list[World] = []
    while todo:
        blob, w = todo.popleft()
        stats["states"] += 1
        assert stats["states"] < limit, "state space larger than expected"
        check(w, cfg)
        nxt = moves(w, cfg, stats, blob)
        if not nxt:
            if not proper_end(w, cfg):
                raise Violation("deadlock: " + describe(w))
            ends.append(w)
            stats["killed" if w.killed else "ends"] = stats.get("killed" if w.killed else "ends", 0) + 1
        for n in nxt:
            k = canon(n)
            if k not in seen:
                seen.add(k)
                todo.append((k, n))
    return stats, ends


def describe(w: World) -> str:
    ranks = [(r.stage, r.tick, r.cursor.phase, list(r.cursor.queue)) for r in w.ranks]
    return (f"coordinator {w.coord.phase} target {target(w)} error {w.coord.error}; ranks {ranks}; "
            f"up {[list(q) for q in w.up]}; down {[list(q) for q in w.down]}")


# -- the explorations ------------------------------------------------------------------------------

def test_two_ranks_pause_and_resume_in_every_order():
    stats, ends = explore(Cfg(world=2, steps=3))
    assert stats["park"] > 0 and stats["regroup"] > 0, stats
    assert "killed" not in stats, stats
    assert all(all(r.tick == 3 for r in w.ranks) for w in ends)   # everyone trained to the end


def test_three_ranks_pause_and_resume_in_every_order():
    # eager_up: every interleaving of the ranks' moves and of the coordinator's deliveries, but a
    # rank's reports arrive at once (the full space of 3 ranks is too large for a unit test).
    stats, ends = explore(Cfg(world=3, steps=1, eager_up=True))
    assert stats["park"] > 0 and stats["regroup"] > 0 and "killed" not in stats, stats
    assert all(all(r.tick == 1 for r in w.ranks) for w in ends)


def test_pause_to_disk_commits_once_and_every_rank_exits():
    stats, ends = explore(Cfg(world=2, steps=3, tier="disk", resume=False))
    assert stats["write"] > 0 and stats["exit"] > 0 and "killed" not in stats, stats
    for w in ends:
        if w.coord.phase == ag.CHECKPOINTED:
            assert w.coord.result["ckpt_path"] == "manifest"
            assert all(r.stage == "exited" for r in w.ranks)


def test_withdrawn_at_any_moment_leaves_every_rank_training():
    # two steps: the withdrawal can still come at every moment of an attempt, before, between and
    # after the ranks' safepoints (three steps add only more of the same, at 3x the time)
    stats, ends = explore(Cfg(world=2, steps=2, withdraw=True))
    assert "killed" not in stats and stats["park"] > 0, stats
    assert all(all(r.tick == 2 for r in w.ranks) for w in ends)


def test_end_of_training_with_done_messages_never_needs_the_deadline():
    # the pause may come as late as the last step: ranks that finish say so and the attempt ends
    stats, ends = explore(Cfg(world=2, steps=2, final_barrier=True, done_msg=True))
    assert "killed" not in stats and stats["park"] > 0, stats


def test_end_of_training_without_done_messages_needs_no_deadline():
    # A raw loop that ends in a barrier and never says `done`: a rank that already left its last
    # safepoint bounds itself at steps+1, so the target is one no rank reaches, nobody waits at
    # it, and the ranks' exits withdraw the attempt. No deadlock, no deadline needed.
    stats, ends = explore(Cfg(world=2, steps=2, final_barrier=True, done_msg=False))
    assert "killed" not in stats and stats["park"] > 0, stats
    assert all(all(r.stage == "exited" for r in w.ranks) for w in ends)


def test_deadline_at_any_moment_ends_in_a_defined_state():
    stats, ends = explore(Cfg(world=2, steps=2, deadline=True))
    for w in ends:
        if w.killed:   # only after something was torn down; an agreement is simply withdrawn
            assert w.coord.phase == ag.FAILED and "within" in (w.coord.error or ""), describe(w)


@pytest.mark.parametrize("failing", [(0, rc.PARK), (1, rc.PARK), (1, rc.UNPARK), (0, rc.REGROUP)])
def test_a_failed_action_on_one_rank(failing):
    stats, ends = explore(Cfg(world=2, steps=2, fail=failing))
    assert stats.get("ends", 0) > 0, stats
    if failing[1] == rc.REGROUP:
        assert stats.get("killed", 0) > 0        # a group that cannot be rebuilt ends the job
    else:
        assert "killed" not in stats, stats
        # a failed park trains on, a failed resume is retried: every rank reaches the end
        assert all(all(r.tick == 2 for r in w.ranks) for w in ends)


def test_spill_from_ram_to_disk_and_its_failure():
    stats, _ = explore(Cfg(world=2, steps=2, spill=True, resume=False))
    assert stats["write"] > 0 and "killed" not in stats, stats
    stats, _ = explore(Cfg(world=2, steps=2, spill=True, resume=True, fail=(1, rc.WRITE)))
    assert "killed" not in stats and stats["regroup"] > 0, stats
