"""Lightning `strategy="ddp"` on 2 CPU processes (a plain-script launch: rank 0 starts rank 1)
with SafepointCallback, under a real daemon: every rank attaches; the job is paused to RAM (each
rank destroys its process group, parks, makes the group again and the runtime rebinds the DDP
wrapper the callback handed it), then to disk mid-epoch (every rank writes its part, the job is
requeued, and in the restarted processes each rank's callback hands Lightning the checkpoint dict
from its own part in `setup`); it ends bitwise equal, rank by rank, to the same fit outside
gpuswap, and the restarted ranks train on the batches the uninterrupted fit had left.
docs/frameworks.md, "Multi-process"."""
from __future__ import annotations

import sys

import pytest

from fw_runner import require

require("lightning", "lightning")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from fw_ranks import finish_reference, park_ram_then_disk, results, start_reference  # noqa: E402
from fw_runner import HERE  # noqa: E402

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS = 12  # 3 epochs x 4 optimizer steps (2 batches each: accumulate_grad_batches=2) per rank
RAM_AT, DISK_AT = 2, 5  # optimizer steps (0-based); 5 is the second step of epoch 1: mid-epoch


def test_lightning_ddp_parked_in_ram_then_to_disk_ends_bitwise_equal(make_daemon, home):
    job = [sys.executable, str(HERE / "lightning_ddp_job.py")]
    ref = start_reference(job + [str(home / "ref")], home)
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    park_ram_then_disk(d, job + [str(home / "out")], home, RAM_AT, DISK_AT)
    finish_reference(ref)
    base, got = results(home / "ref"), results(home / "out")
    left = (STEPS - DISK_AT - 1) * 2   # batches the restarted processes train on
    for rank, (a, b) in enumerate(zip(base, got)):
        assert (a["job"], b["job"], b["restored_step"]) == ("NullJob", "RankJob", DISK_AT), rank
        # one tick per optimizer step; the restarted processes count theirs from the restored step on
        assert b["ticks"] == STEPS - DISK_AT - 1 and a["global_step"] == b["global_step"] == STEPS
        assert len(a["batches"]) == STEPS * 2 and b["batches"] == a["batches"][-left:], f"rank {rank} trained on other batches"
        for key in ("params", "optimizer", "rng", "lr"):
            assert b[key] == a[key], f"rank {rank} {key}"
    assert base[0]["batches"] != base[1]["batches"]   # the ranks really split the data
