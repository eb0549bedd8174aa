"""Hugging Face's SafepointCallback with a real Trainer on CPU (tiny BERT from a config, no
hub): parked to RAM, and to disk (exit 75, restart, the Trainer resumes global step, epoch, data
position and RNG through its own resume_from_checkpoint path), training ends bitwise equal to
an uninterrupted run."""
from __future__ import annotations

import pytest

from fw_runner import require, run_all

require("hf", "transformers", "accelerate")

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

JOB = "hf_job.py"  # 3 epochs x 12 steps of 8 samples; shuffled, dropout, AdamW, linear warmup/decay
BATCH = 8


PLAN = "ram:10,disk:16"  # a RAM park at step 10, then a disk park mid-epoch 1 at step 16


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    r = run_all(JOB, tmp_path_factory.mktemp("hf"), [PLAN])
    assert r["baseline"]["global_step"] == 36 and r["baseline"]["restored_step"] is None
    return r


def test_ram_then_disk_park_resumes_trainer_state_exactly(runs: dict) -> None:
    base, r = runs["baseline"], runs[PLAN]
    assert r["parked_bytes"] and r["parked_bytes"][0] > 0  # the RAM park released the memory
    assert r["restored_step"] == 16
    assert (r["global_step"], r["epoch"], r["lr"]) == (36, 3.0, base["lr"])
    # the Trainer skips the batches of the interrupted epoch it had already trained on (it loads
    # them again to do so); the samples it trained on after that are the uninterrupted run's
    trained = (36 - 16 - 1) * BATCH
    assert r["samples"][-trained:] == base["samples"][-trained:]
    assert r["sha256"] == base["sha256"]
