"""The gate for a multi-rank job's control messages (protocol/messages.py) and the rank identity a
runtime reads from its launcher's environment (runtime/ranks.py): no processes, no torch."""
from __future__ import annotations

import json

import pytest

from gpuswap.protocol import messages, records, status
from gpuswap.runtime.ranks import RankIdentity, identity


def parse(**msg):
    return messages.parse(json.dumps(msg).encode())


def test_agreement_messages_parse_with_exactly_the_fields_the_coordinator_reads():
    assert records.wire(parse(op="mark", epoch=3, seen=0)) == {"op": "mark", "epoch": 3, "seen": 0}
    assert parse(op="hold", epoch=1, tick=7).tick == 7
    assert parse(op="ready", epoch=1, tick=7, step=6).step == 6
    assert parse(op="unparked", epoch=1, bytes=10, seconds=0.5).bytes == 10
    assert parse(op="paused", epoch=2, tier="ram", bytes=5).epoch == 2
    assert parse(op="done").op == "done"
    h = parse(op="hello", pid=10, rank=1, world_size=2, local_rank=1, epoch=4, state="parked",
              ram_refusal="an FSDP1 module")
    assert (h.rank, h.world_size, h.state, h.ram_refusal) == (1, 2, "parked", "an FSDP1 module")
    part = parse(op="part", epoch=2, file="ckpt-000009.r1.pt", bytes=20133, sha256="ab" * 32, seconds=0.1)
    assert (part.file, part.bytes) == ("ckpt-000009.r1.pt", 20133)
    c = parse(op="committed", epoch=2, seq=9, path="/ck/ckpt-000009.json", bytes=5)
    assert (c.seq, c.path) == (9, "/ck/ckpt-000009.json")
    assert parse(op="hello", rank=0, world_size=2, restored_seq=9).restored_seq == 9


@pytest.mark.parametrize("msg", [
    {"op": "hello", "rank": 0, "world_size": 0},
    {"op": "hello", "rank": 0, "world_size": 1025},
    {"op": "hello", "rank": -1, "world_size": 2},
    {"op": "hello", "rank": 1024, "world_size": 2},
    {"op": "hello", "rank": 0, "world_size": 2, "state": "dancing"},
    {"op": "hello", "rank": True, "world_size": 2},
    {"op": "mark", "epoch": 1},                      # no tick: not a bound
    {"op": "mark", "epoch": 1, "seen": -1},
    {"op": "mark", "epoch": 2**40, "seen": 1},
    {"op": "hold", "epoch": 1, "tick": 1.5},
    {"op": "ready", "epoch": "1", "tick": 1},
    {"op": "unparked"},
    {"op": "part", "epoch": 1, "file": "../ckpt-000009.r1.pt", "bytes": 1, "sha256": "ab" * 32},   # a path
    {"op": "part", "epoch": 1, "file": "/x/ckpt-000009.r1.pt", "bytes": 1, "sha256": "ab" * 32},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt\n", "bytes": 1, "sha256": "ab" * 32},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.json", "bytes": 1, "sha256": "ab" * 32},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": -1, "sha256": "ab" * 32},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": 2**60, "sha256": "ab" * 32},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": 1, "sha256": "AB" * 32},  # not lower hex
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": 1, "sha256": "ab" * 31},
    {"op": "part", "epoch": 1, "file": "ckpt-000009.r1.pt", "bytes": 1},
    {"op": "committed", "epoch": 1, "seq": 0, "path": "/ck/x.json"},
    {"op": "committed", "epoch": 1, "seq": 2**60, "path": "/ck/x.json"},
    {"op": "committed", "epoch": 1, "seq": 3, "path": "/" + "x" * 5000},
    {"op": "committed", "epoch": 1, "seq": 3},
    {"op": "hello", "rank": 0, "world_size": 2, "restored_seq": -1},
])
def test_bad_rank_messages_are_refused(msg):
    with pytest.raises(messages.BadMessage):
        messages.parse(json.dumps(msg).encode())


def test_rank_facts_read_back_by_the_daemon_are_validated():
    rt = status.runtime_facts({"world_size": 2, "ranks": [
        {"rank": 0, "pid": 11, "connected": True, "state": "parked", "device_bytes": 5},
        {"rank": 1, "pid": 12, "connected": False, "state": "gone"}], "not_pausable": "1 of 2 ranks attached"})
    assert [r.state for r in rt.ranks] == ["parked", "gone"] and rt.not_pausable == "1 of 2 ranks attached"
    assert status.runtime_facts({"ranks": [{"rank": 0, "device_bytes": 2**60}]}).ranks is None
    assert status.runtime_facts({"world_size": 5000}).world_size is None
    assert status.rank_pids([{"pid": 5, "start_ticks": 9}, {"pid": "x"}, {"pid": 2**40}, 7]) == [(5, 9)]


@pytest.mark.parametrize("env, want", [
    ({}, RankIdentity(0, 1, 0)),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, RankIdentity(1, 4, 1)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0"}, RankIdentity(2, 3, 0)),
    ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, RankIdentity(0, 2, 0)),
    ({"RANK": "4", "WORLD_SIZE": "2"}, RankIdentity(0, 1, 0)),          # nonsense: a single rank
    ({"RANK": "x", "WORLD_SIZE": "2"}, RankIdentity(0, 1, 0)),
    ({"RANK": "0", "WORLD_SIZE": "99999"}, RankIdentity(0, 1, 0)),
])
def test_rank_identity_from_the_launchers_environment(env, want):
    assert identity(env) == want


@pytest.mark.parametrize("env, group, want", [
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2), RankIdentity(1, 2, 1)),    # Lightning's child rank
    ({}, (3, 4), RankIdentity(3, 4, 3)),                                       # mp.spawn: nothing in env
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2), RankIdentity(1, 2, 1)),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, (1, 2), RankIdentity(1, 2, 0)),
    ({"WORLD_SIZE": "2"}, (0, 1), RankIdentity(0, 1, 0)),                       # a group of one: a single rank
])
def test_rank_identity_from_the_initialized_default_group(env, group, want):
    assert identity(env, group) == want
