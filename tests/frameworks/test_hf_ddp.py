"""Hugging Face Trainer on 2 CPU processes (gloo; accelerate builds the DDP wrapper) with
SafepointCallback, under a real daemon and `accelerate launch`: every rank attaches
`trainer.model_wrapped`; the job is paused to RAM (each rank destroys its process group, parks,
makes the group again and the runtime rebinds the wrapper), then to disk mid-epoch (every rank
writes its part, the job is requeued; in the restarted processes each rank's callback unpacks rank
0's Trainer files, which alone hold weights and optimizer, with its own RNG file over them, and
the Trainer resumes from them); it ends bitwise equal, rank by rank, to the same script under
plain torchrun: one run covers both launchers (`accelerate launch`
with several processes runs torchrun's agent, `torch.distributed.run.run`).
docs/frameworks.md, "Multi-process"."""
from __future__ import annotations

import sys

import pytest

from fw_runner import require

require("hf", "transformers", "accelerate")
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("this torch has no torch.distributed with gloo", allow_module_level=True)

from fw_ranks import finish_reference, park_ram_then_disk, results, start_reference  # noqa: E402
from fw_runner import HERE  # noqa: E402

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

STEPS = 12  # 2 epochs x 6 optimizer steps (2 batches of 4 per rank each: gradient_accumulation_steps=2)
PER_STEP = 8  # samples per rank and optimizer step
RAM_AT, DISK_AT = 2, 7  # optimizer steps (0-based); 7 is the second step of epoch 1: mid-epoch
JOB = str(HERE / "hf_ddp_job.py")
# --standalone binds the rendezvous store to port 0, --main_process_port 0 picks a free one:
# parallel runs never share a port. (`--cpu --num_processes 2` would start one process: accelerate
# runs several CPU processes only through mpirun; `--multi_gpu` is its torchrun path, CPU included.)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", JOB]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "0", JOB]


def test_hf_trainer_under_accelerate_launch_parked_in_ram_then_to_disk_ends_bitwise_equal(make_daemon, home):
    ref = start_reference(TORCHRUN + [str(home / "ref")], home)
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1")
    park_ram_then_disk(d, ACCELERATE + [str(home / "out")], home, RAM_AT, DISK_AT)
    finish_reference(ref)
    base, got = results(home / "ref"), results(home / "out")
    left = (STEPS - DISK_AT - 1) * PER_STEP   # samples the restarted processes train on
    for rank, (a, b) in enumerate(zip(base, got)):
        assert (a["job"], b["job"], b["wrapper"], b["world"]) == ("NullJob", "RankJob", "DistributedDataParallel", 2)
        assert b["restored_step"] == DISK_AT, rank
        # one tick per optimizer step but the last (training is over: nothing to resume); the
        # restarted processes count theirs from the restored step on
        assert b["ticks"] == STEPS - DISK_AT - 2 and a["global_step"] == b["global_step"] == STEPS
        assert len(a["samples"]) == STEPS * PER_STEP, rank
        assert b["samples"][-left:] == a["samples"][-left:], f"rank {rank} trained on other samples"
        for key in ("params", "optimizer", "rng", "lr"):
            assert b[key] == a[key], f"rank {rank} {key}"
    assert base[0]["samples"] != base[1]["samples"]   # the ranks really split the data
