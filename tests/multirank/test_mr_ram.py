"""A torchrun DDP job of 2 ranks under a real daemon (gloo, simulated GPUs): paused to RAM twice
by the daemon (every rank at one common step, its process group destroyed and made again),
resumed, and ending bitwise equal, rank by rank, to the same script under plain torchrun.
`show` and `ls` list the ranks. docs/design/multi-rank.md, sections 2 and 3."""
from __future__ import annotations

import json

from mr_testing import assert_bitwise, load, reference, torchrun
from gpuswap_testing import Gate

STEPS, HOLD_AT = 24, 22


def test_two_ranks_parked_in_ram_twice_end_bitwise_equal(make_daemon, home):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    gate, out, ref = Gate(home / "go"), home / "out", home / "ref"
    job = d.submit(torchrun(2, "--steps", str(STEPS), "--out", str(out), "--gate", str(gate.path),
                            "--hold-at", str(HOLD_AT)), name="mr", gpus=2)
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and len(j["ranks"]) == 2)
    for n in (1, 2):
        assert d.cli("pause", str(job), "--to", "ram").returncode == 0
        j = d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "ram"
                    and all(r["state"] == "parked" for r in j["ranks"]))
        assert j["parked_bytes"] > 0 and sorted(r["rank"] for r in j["ranks"]) == [0, 1]
        ls = d.cli("ls")
        assert "PAUSED (parked in RAM, 2 ranks," in ls.stdout, ls.stdout
        show = d.cli("show", str(job)).stdout
        for r in j["ranks"]:
            assert f"rank {r['rank']}" in show and f"parked, pid {r['pid']}" in show, show
        assert d.cli("resume", str(job)).returncode == 0
        d.until(job, lambda j: j["state"] == "RUNNING"
                and sum(e["reason"].startswith("resumed from RAM") for e in j["events"]) == n)
    gate.open()
    done = d.state(job, "COMPLETED", "FAILED")
    assert done["state"] == "COMPLETED", json.dumps(done["events"], indent=1)
    assert sum(e["reason"].startswith("parked in RAM") for e in done["events"]) == 2
    reference(ref, 2, STEPS)
    for rank in (0, 1):
        a, b = load(ref, rank), load(out, rank)
        for key in ("params", "optimizer", "rng", "data"):
            assert_bitwise(a[key], b[key], f"rank {rank} {key}")
