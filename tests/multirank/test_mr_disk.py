"""A torchrun DDP job of 2 ranks under a real daemon (gloo, simulated GPUs) parked to disk: every
rank writes its part at one common step, rank 0 commits the manifest, the job leaves, is requeued,
restarts and every rank restores (docs/design/multi-rank.md section 4). Paused to RAM, to disk
and spilled from RAM to disk in one run, it ends bitwise equal, rank by rank, to plain torchrun.
Failures: a rank whose part cannot be written makes the attempt resume every rank (the job
trains on, the event says why); rank 0 killed after the parts are durable but before the
manifest leaves the previous checkpoint standing."""
from __future__ import annotations

import pytest

import json

from mr_testing import completes_bitwise, torchrun
from gpuswap_testing import Gate

from gpuswap.runtime import ckparts

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS, HOLDS = 24, (6, 12, 18)


def _submit(d, home, name, out, gate):
    fail = home / f"{name}.fail"
    fail.mkdir()
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", ",".join(map(str, HOLDS)), "--fail-dir", str(fail)), name=name, gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2
            and all(r["connected"] for r in j["ranks"]))
    return job, fail


def _events(j, start):
    return sum(e["reason"].startswith(start) for e in j["events"])


def _to_disk(d, job, n):
    """Wait for the n-th disk park; `ls` says where the job is while it is there."""
    j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk"
                and _events(j, "parked to disk") == n)
    ls = d.cli("ls").stdout
    assert "PAUSED (parked on disk, 2 ranks," in ls, ls
    show = d.cli("show", str(job)).stdout
    assert "PAUSED (parked on disk, 2 ranks," in show and "written, pid" in show, show
    return j


def _restarted(d, job, n):
    assert d.cli("resume", str(job)).returncode == 0
    return d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "restarted from its disk checkpoint") == n
                   and len(j["ranks"]) == 2 and all(r["connected"] for r in j["ranks"]))


def test_two_ranks_paused_to_ram_and_disk_and_spilled_end_bitwise_equal(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, out, ref = Gate(home / "go"), home / "out", home / "ref"
    job, fail = _submit(d, home, "mr", out, gate)
    # A part that cannot be written (rank 1's disk is "full"): every rank trains on.
    (fail / "part-r1").touch()
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    j = d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "park failed") == 1)
    why = next(e["reason"] for e in j["events"] if e["reason"].startswith("park failed"))
    assert "rank 1" in why and "No space left on device" in why, why
    assert not (fail / "part-r1").exists()
    # RAM, resumed.
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram")
    assert d.cli("resume", str(job)).returncode == 0
    d.until(job, lambda j: j["state"] == "RUNNING" and _events(j, "resumed from RAM") == 1)
    # Disk: the job leaves; its checkpoint is one manifest over two parts.
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    j = _to_disk(d, job, 1)
    ckpt = home / "jobs" / str(job) / "ckpt"
    manifests = sorted(ckpt.glob("ckpt-*.json"))
    doc = json.loads(manifests[-1].read_text())
    assert doc["format"] == ckparts.FORMAT and doc["world_size"] == 2 and len(doc["parts"]) == 2
    assert j["step"] == doc["step"]
    j = _restarted(d, job, 1)
    # RAM, then spilled to disk from the host copies.
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram" and _events(j, "parked in RAM") == 2)
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    _to_disk(d, job, 2)
    j = _restarted(d, job, 2)
    # Each restart names the step its park named (a spill's is the RAM park's step).
    parked = [e["reason"].split(" at step ")[1].split(" ")[0] for e in j["events"]
              if e["reason"].startswith("parked to disk")]
    restarted = [e["reason"].split(" at step ")[1].split(" ")[0] for e in j["events"]
                 if e["reason"].startswith("restarted from its disk checkpoint")]
    assert parked == restarted and len(parked) == 2, j["events"]
    completes_bitwise(d, job, gate, ref, out, STEPS)


def test_rank_0_killed_before_the_manifest_leaves_the_previous_checkpoint(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate = Gate(home / "go")
    job, fail = _submit(d, home, "k", home / "k", gate)
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    _to_disk(d, job, 1)
    ckpt = home / "jobs" / str(job) / "ckpt"
    first = sorted(ckpt.glob("ckpt-*.json"))
    _restarted(d, job, 1)
    (fail / "manifest").touch()
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    j = d.state(job, "FAILED", "COMPLETED", "PAUSED")
    assert j["state"] == "FAILED", j["events"]
    assert "rank 0" in j["events"][-1]["reason"], j["events"][-1]
    # Both ranks' parts of the second checkpoint are durable; no manifest commits them.
    assert sorted(ckpt.glob("ckpt-*.json")) == first
    seq = int(first[-1].name[5:11])
    assert sorted(p.name for p in ckpt.glob(f"ckpt-{seq + 1:06d}.r*.pt")) == [ckparts.part_name(seq + 1, r)
                                                                              for r in (0, 1)]
    for rank in (0, 1):
        chosen, _ = ckparts.choose(ckpt, rank, 2)
        assert chosen is not None and chosen.info.seq == seq
    gate.open()
