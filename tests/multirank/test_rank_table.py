"""The supervisor's rank table (runtime/ranktable.py) around the disk tier, without processes: ranks that
restored different checkpoints end the job; what the daemon reads after a disk park."""
from __future__ import annotations

import json
import os
import socket

from gpuswap.protocol import messages, records
from gpuswap.protocol.rundir import Desired
from gpuswap.protocol.status import runtime_facts
from gpuswap.runtime.ranktable import RankTable


def _table():
    kills: list[str] = []
    return RankTable(30.0, kills.append, lambda text: None), kills


def _hello(t, rank, **fields):
    a, b = socket.socketpair()
    msg = records.Hello(pid=os.getpid(), rank=rank, world_size=2, **fields)
    # Both "ranks" are this process: the table ties a connection to the kernel's peer pid.
    return t.hello(a, msg, os.getpid() + rank, 0.0), (a, b)


def test_ranks_that_restored_different_checkpoints_end_the_job():
    t, kills = _table()
    ok0, s0 = _hello(t, 0, restored_seq=4, restored_step=39)
    ok1, s1 = _hello(t, 1, restored_seq=3, restored_step=29)
    assert ok0 and ok1
    assert kills and "restored different checkpoints" in kills[0] and "checkpoint 4" in kills[0], kills
    for a, b in (s0, s1):
        a.close()
        b.close()


def test_the_same_checkpoint_everywhere_is_what_the_daemon_reads():
    t, kills = _table()
    _, s0 = _hello(t, 0, restored_seq=4, restored_step=39, restored_bytes=100, restore_s=0.5)
    _, s1 = _hello(t, 1, restored_seq=4, restored_step=39, restored_bytes=100, restore_s=0.75)
    assert not kills
    f = runtime_facts(t.facts())
    assert (f.restored_step, f.restored_bytes, f.restore_s, f.restored_seq) == (39, 100, 0.75, 4)
    for a, b in (s0, s1):
        a.close()
        b.close()


def test_a_ram_park_that_went_to_disk_says_why_in_the_note():
    t, _ = _table()
    _, s0 = _hello(t, 0, ram_refusal="an FSDP1 module")
    _, s1 = _hello(t, 1)
    t.want(Desired(run="paused", tier="ram"), 0.0)
    conns = {0: s0[0], 1: s1[0]}

    def say(rank, **msg):
        t.receive(conns[rank], messages.parse(json.dumps(dict(msg, epoch=1)).encode()), 0.0)

    for r in (0, 1):
        say(r, op="mark", seen=5)
    for r in (0, 1):
        say(r, op="ready", tick=6)
    assert s0[1].recv(4096).endswith(b'{"op":"park","epoch":1,"tier":"disk"}\n')  # asked for RAM
    for r in (0, 1):
        say(r, op="part", file=f"ckpt-000001.r{r}.pt", bytes=10, sha256="ab" * 32)
    say(0, op="committed", seq=1, path="/ck/ckpt-000001.json", bytes=20, step=5)
    f = runtime_facts(t.facts())
    assert (f.state, f.tier, f.ckpt_path, f.step) == ("checkpointed", "disk", "/ck/ckpt-000001.json", 5)
    assert f.ckpt_note == "RAM park refused: cannot rebuild the process group (rank 0: an FSDP1 module)"
    assert "why_disk" not in t.facts()
    for a, b in (s0, s1):
        a.close()
        b.close()
