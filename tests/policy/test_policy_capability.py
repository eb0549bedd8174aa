"""policy/capability.py: how a job can be parked (mechanism, tiers, why not) and what a park of a
multi-rank job costs: the slowest rank's copy plus the group's fixed cost, capped by the host's
bandwidth; disk parts share one filesystem. Pure tables."""
import pytest

from gpuswap.policy import Phase, PolicyConfig, SwitchCosts
from gpuswap.policy.capability import (NCCL_TRANSPARENT_REFUSAL, MULTI_RANK_OFF, NO_MECHANISM, TRANSPARENT_RAM_ONLY,
                                       UNRESPONSIVE, Parkability, multi_rank_park_s, multi_rank_resume_s,
                                       park_s, parkability, resume_s)
from gpuswap.policy.costs import park_plan, switch_s
from policy_helpers import GiB, job

BOTH, RAM, DISK, NONE = frozenset({"ram", "disk"}), frozenset({"ram"}), frozenset({"disk"}), frozenset()


@pytest.mark.parametrize("width, runtime, transparent_ok, ram_refusal, expected", [
    # one process: today's rules
    (1, "cooperative", False, None, Parkability("cooperative", BOTH)),
    (1, "cooperative", True, None, Parkability("cooperative", BOTH)),
    (1, "auto", True, None, Parkability("transparent", RAM, TRANSPARENT_RAM_ONLY)),
    (1, "auto", False, None, Parkability("cooperative", BOTH)),
    (1, "none", True, None, Parkability("transparent", RAM, TRANSPARENT_RAM_ONLY)),
    (1, "none", False, None, Parkability("none", NONE, NO_MECHANISM)),
    (1, "unresponsive", True, None, Parkability("none", NONE, UNRESPONSIVE)),
    # several ranks: cooperative only, never the driver
    (4, "cooperative", True, None, Parkability("cooperative", BOTH)),
    (8, "cooperative", False, None, Parkability("cooperative", BOTH)),
    (4, "auto", True, None, Parkability("cooperative", BOTH, NCCL_TRANSPARENT_REFUSAL)),
    (4, "none", True, None, Parkability("none", NONE, NCCL_TRANSPARENT_REFUSAL)),
    (8, "none", False, None, Parkability("none", NONE, NO_MECHANISM)),
    # a runtime that cannot rebuild its group parks to disk, and says why
    (4, "cooperative", False, "FSDP1 module", Parkability("cooperative", DISK, "no RAM park: FSDP1 module; parks to disk")),
    (1, "cooperative", False, "process subgroups of its own",
     Parkability("cooperative", DISK, "no RAM park: process subgroups of its own; parks to disk")),
])
def test_parkability_table(width, runtime, transparent_ok, ram_refusal, expected):
    assert parkability(width, runtime, None, transparent_ok, ram_refusal) == expected


def test_framework_fsdp1_cannot_park_to_ram_and_the_refusal_reason_is_kept():
    p = parkability(4, "cooperative", "fsdp1")
    assert p.tiers == DISK and "FSDP1" in p.why_not
    assert parkability(4, "cooperative", "ddp").tiers == BOTH
    refused = parkability(1, "none", None, False, transparent_refused="lock timed out after 10 s")
    assert refused == Parkability("none", NONE, "lock timed out after 10 s")


def test_multi_rank_off_makes_wide_jobs_unparkable_and_leaves_one_rank_alone():
    assert parkability(8, "cooperative", "ddp", multi_rank=False) == Parkability("none", NONE, MULTI_RANK_OFF)
    assert parkability(1, "cooperative", "ddp", multi_rank=False) == Parkability("cooperative", BOTH)


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        parkability(0, "cooperative")
    with pytest.raises(ValueError):
        parkability(1, "magic")


C = SwitchCosts(ram_park_bps=20e9, ram_resume_bps=25e9, disk_write_bps=1e9, disk_read_bps=2e9,
                ram_fixed_s=0.5, disk_fixed_s=10.0, group_teardown_s=1.0, group_rebuild_s=5.0,
                host_copy_bps=100e9)


def test_width_one_is_the_single_process_arithmetic_to_the_bit():
    for nbytes in (0, 1, 12 * GiB, 77 * GiB + 3):
        for tier in ("ram", "disk"):
            assert park_s(C, nbytes, tier, 1) == C.park_s(nbytes, tier)
            assert resume_s(C, nbytes, tier, 1) == C.resume_s(nbytes, tier)
            assert multi_rank_park_s(C, [nbytes], tier) == C.park_s(nbytes, tier)


@pytest.mark.parametrize("per_rank, park, resume", [
    # 4 x 10 GB: 40 GB at min(4 x 20, 100) = 80 GB/s -> 0.5 s; the slowest rank alone also 0.5 s
    ([10e9] * 4, 0.5 + 1.0 + 0.5, 0.5 + 5.0 + max(10e9 / 25e9, 40e9 / 100e9)),
    # 8 x 10 GB: host-bound, 80 GB / 100 GB/s = 0.8 s (not 10 GB / 20 GB/s = 0.5 s)
    ([10e9] * 8, 0.5 + 1.0 + 0.8, 0.5 + 5.0 + 0.8),
    # uneven ranks: the slowest rank's copy, not the sum over one link
    ([30e9, 2e9, 2e9, 2e9], 0.5 + 1.0 + 30e9 / 20e9, 0.5 + 5.0 + 30e9 / 25e9),
])
def test_ram_park_costs_the_slowest_rank_plus_the_group_capped_by_the_host(per_rank, park, resume):
    assert multi_rank_park_s(C, per_rank, "ram") == pytest.approx(park)
    assert multi_rank_resume_s(C, per_rank, "ram") == pytest.approx(resume)


def test_disk_parts_share_one_filesystem_and_the_restart_rebuilds_the_group():
    per_rank = [10e9] * 4
    assert multi_rank_park_s(C, per_rank, "disk") == pytest.approx(0.5 + 40e9 / 1e9)
    assert multi_rank_resume_s(C, per_rank, "disk") == pytest.approx(10.0 + 5.0 + 40e9 / 2e9)


def test_width_4_and_8_against_one_rank_holding_the_same_bytes():
    nbytes = 8 * 12 * GiB
    one = park_s(C, nbytes, "ram", 1) + resume_s(C, nbytes, "ram", 1)
    eight = park_s(C, nbytes, "ram", 8) + resume_s(C, nbytes, "ram", 8)
    four = park_s(C, nbytes, "ram", 4) + resume_s(C, nbytes, "ram", 4)
    # parallel copies: 8 ranks are host-bound (96 GiB / 100 GB/s each way) plus 1 + 5 s of group
    assert eight == pytest.approx(0.5 + 1.0 + nbytes / 100e9 + 0.5 + 5.0 + nbytes / 100e9)
    assert four == pytest.approx(0.5 + 1.0 + nbytes / 80e9 + 0.5 + 5.0 + nbytes / 100e9)
    assert one == pytest.approx(0.5 + nbytes / 20e9 + 0.5 + nbytes / 25e9)
    # the group's fixed cost is overridable
    cheap = SwitchCosts(group_teardown_s=0.0, group_rebuild_s=0.0)
    assert park_s(cheap, nbytes, "ram", 8) == pytest.approx(0.5 + nbytes / 100e9)


def test_the_policy_charges_a_wide_job_what_capability_says():
    costs = SwitchCosts()
    wide = job("w", Phase.RUNNING, gpus=8, mem_gib=12, width=8)
    nbytes = 8 * 12 * GiB
    rt = park_s(costs, nbytes, "ram", 8) + resume_s(costs, nbytes, "ram", 8)
    assert switch_s(wide, "ram", costs) == pytest.approx(rt)
    plan = park_plan(wide, float("inf"), tuple, costs, PolicyConfig())
    assert plan.tier == "ram" and plan.gpu_s == pytest.approx(rt * 8)
    single_process = job("s", Phase.RUNNING, gpus=8, mem_gib=12)          # width 1: one process, 8 GPUs
    assert switch_s(single_process, "ram", costs) == costs.park_s(nbytes, "ram") + costs.resume_s(nbytes, "ram")


def test_pending_reasons_say_why_a_job_cannot_be_parked():
    from gpuswap.policy.victims import protection
    from policy_helpers import gpus, snap
    v = job("w", Phase.RUNNING, gpus=2, assigned=(0, 1), tiers=frozenset(), width=2, why_not=NCCL_TRANSPARENT_REFUSAL)
    code, text, _ = protection(v, snap(1000, gpus(2), [v]))
    assert code == "NotParkable" and text == f"cannot be parked: {NCCL_TRANSPARENT_REFUSAL}"
    old = job("o", Phase.RUNNING, assigned=(0,), tiers=frozenset())
    assert protection(old, snap(1000, gpus(1), [old]))[1] == \
        "cannot be parked: no gpuswap runtime attached and no driver freeze"
