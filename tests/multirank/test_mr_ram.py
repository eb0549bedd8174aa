"""torchrun jobs of 2 and 4 ranks under a real daemon (gloo, simulated GPUs): paused to RAM twice
by the daemon (every rank at one common step, its process group destroyed and made again,
DDP / ZeroRedundancyOptimizer / FSDP2 rebound), resumed, and ending bitwise equal, rank by rank,
to the same script under plain torchrun. `show` and `ls` list the ranks.
docs/design/multi-rank.md, sections 2 and 3.

Starting torchrun is most of a case's cost, so the 2-rank case trains DDP, DDP + ZeRO and FSDP2
side by side in one job (mr_job.py `--modes`); the 4-rank case trains DDP. In the 2-rank case the
DDP training reduces through a communication hook that watches its bucket buffers
(`--probe-buckets`): they are gone while the job is parked (DDP's Reducer, which holds them out of
Python's reach, is made again at resume: runtime/ddpreducer.py) and back, full size, after it."""
from __future__ import annotations

import json

import pytest

from mr_testing import assert_bitwise, load, reference, start_reference, torchrun
from gpuswap_testing import Gate

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLD_AT = 24, 22


@pytest.mark.parametrize("nproc, modes, extra", [(2, "ddp,zero,fsdp2", ("--probe-buckets",)), (4, "ddp", ())])
def test_ranks_parked_in_ram_twice_end_bitwise_equal(make_daemon, home, nproc, modes, extra):
    d = make_daemon("--simulate-gpus", f"{nproc}x80GiB", "--min-runtime", "1")
    gate, out, ref = Gate(home / "go"), home / "out", home / "ref"
    job = d.submit(torchrun(nproc, "--steps", str(STEPS), "--out", str(out), "--modes", modes,
                            "--gate", str(gate.path), "--hold-at", str(HOLD_AT), *extra), name="mr", gpus=nproc)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == nproc)
    start_reference(ref, nproc, STEPS, modes, *extra)      # meanwhile (mr_testing.start_reference)
    parked = []
    for n in (1, 2):
        assert d.cli("pause", str(job), "--to", "ram").returncode == 0
        j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
                    and all(r["state"] == "parked" for r in j["ranks"]))
        assert sorted(r["rank"] for r in j["ranks"]) == list(range(nproc))
        parked.append(j["parked_bytes"])
        ls = d.cli("ls")
        assert f"PAUSED (parked in RAM, {nproc} ranks," in ls.stdout, ls.stdout
        show = d.cli("show", str(job)).stdout
        for r in j["ranks"]:
            assert f"rank {r['rank']}" in show and f"parked, pid {r['pid']}" in show, show
        assert d.cli("resume", str(job)).returncode == 0
        d.until(job, lambda j: j["state"] == "RUNNING"
                and sum(e["reason"].startswith("resumed from RAM") for e in j["events"]) == n)
    # The daemon learned the group's teardown and rebuild from the ranks' reports (the slowest
    # rank's), not the single-GPU bandwidths, which a multi-rank pause_s would skew.
    bw = json.loads(d.cli("gpus", "--json").stdout)["bandwidths"]
    for field in ("group_teardown_s", "group_rebuild_s"):
        assert bw[field]["source"] == "measured: 2 real move(s)", bw
        assert 0 < bw[field]["seconds"] < 60, bw
    assert bw["ram_park_bps"]["samples"] == bw["ram_resume_bps"]["samples"] == 0, bw
    assert "multi-rank switches: group teardown" in d.cli("gpus").stdout
    gate.open()
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", json.dumps(done["events"], indent=1)
    assert sum(e["reason"].startswith("parked in RAM") for e in done["events"]) == 2
    reference(ref, nproc, STEPS, modes, *extra)
    first = modes.split(",")[0]
    # Every byte of training state left the device: parameters, gradients and optimizer state of
    # every mode on every rank (a ZeRO shard's moments live in its local optimizer).
    held = sum(load(out / first, rank)["state_bytes"] for rank in range(nproc))
    assert parked == [held, held], (parked, held)
    for mode in modes.split(","):
        for rank in range(nproc):
            a, b = load(ref / mode, rank), load(out / mode, rank)
            assert (a["groups"], b["groups"]) == (1, 3)   # two parks, each a new default group
            assert b["bound"], f"{mode} rank {rank}: still holds a destroyed group"
            for key in ("params", "optimizer", "rng", "data"):
                assert_bitwise(a[key], b[key], f"{mode} rank {rank} {key}")
    for rank in range(nproc) if extra else ():
        seen = load(out / "ddp", rank)["buckets"]
        # Both parks: every bucket buffer of the last backward was freed once the rank was parked.
        assert len(seen["parked"]) == 2 and all(p and all(p) for p in seen["parked"]), (rank, seen)
        assert seen["live_bytes"] == seen["param_bytes"] > 0, (rank, seen)   # and back after resume
