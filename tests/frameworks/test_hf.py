"""Hugging Face's SafepointCallback with a real Trainer on CPU (tiny BERT from a config, no
hub): parked to RAM, and to disk (exit 75, restart, the Trainer resumes global step, epoch, data
position and RNG through its own resume_from_checkpoint path), training ends bitwise equal to
an uninterrupted run."""
from __future__ import annotations

import pytest

from fw_runner import check_mixed_precision_on_gpu, require, run_all

require("hf", "transformers", "accelerate")

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

JOB = "hf_job.py"  # 3 epochs x 12 steps of 8 samples; shuffled, dropout, AdamW, linear warmup/decay
BATCH = 8


PLAN = "ram:10,disk:16"  # a RAM park at step 10, then a disk park mid-epoch 1 at step 16
END = "disk:23"  # the last step of epoch 1: served at the next epoch's start
SPILL = "spill:10"  # parked in RAM at step 10, then written to disk from the host copies


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    r = run_all(JOB, tmp_path_factory.mktemp("hf"), [PLAN, END])
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



def test_disk_park_at_the_last_step_of_an_epoch(runs: dict) -> None:
    base, r = runs["baseline"], runs[END]
    assert r["restored_step"] == 23
    assert (r["global_step"], r["epoch"], r["lr"]) == (36, 3.0, base["lr"])
    assert r["samples"][-12 * BATCH:] == base["samples"][-12 * BATCH:]   # all of epoch 2
    assert r["sha256"] == base["sha256"]


EVAL_PLAN = "disk:15"  # a disk park at the step the Trainer evaluates at (global step 16)


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_all(JOB, tmp_path_factory.mktemp("hf-eval"), [EVAL_PLAN], env={"FW_HF_EVAL": "1"})


def test_disk_park_at_an_evaluation_step_keeps_the_evaluation(eval_runs: dict) -> None:
    """The Trainer logs, evaluates and saves after `on_step_end`: a park served there, before the
    evaluation, resumed past it (the restarted Trainer starts at the next step), so the evaluation
    at that step was lost and, since evaluating draws from the global RNG (its DataLoader's seed),
    every dropout mask after it differed. The safepoint now comes after them."""
    base, r = eval_runs["baseline"], eval_runs[EVAL_PLAN]
    assert [s for s, _ in base["evals"]] == [8, 16, 24, 32, 36]   # and at the end of training
    assert r["restored_step"] == 15
    assert r["evals"] == base["evals"]   # the restored log history holds step 16's evaluation
    assert (r["global_step"], r["epoch"], r["lr"]) == (36, 3.0, base["lr"])
    assert r["sha256"] == base["sha256"]


EARLY_PLAN = "disk:19"  # after the evaluation at step 16 counted once against the patience


@pytest.fixture(scope="module")
def early_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_all(JOB, tmp_path_factory.mktemp("hf-early"), [EARLY_PLAN], env={"FW_HF_EVAL": "early"})


def test_disk_park_keeps_early_stopping_patience(early_runs: dict) -> None:
    """EarlyStoppingCallback's patience counter (a stateful callback, `TrainerState.stateful_callbacks`)
    was neither captured (only the Trainer's own `_save_checkpoint` refreshes it) nor restored
    (`restore_callback_states_from_checkpoint` defaults to False): the resumed run counted its
    patience from zero and trained on past the step the uninterrupted run stopped at."""
    base, r = early_runs["baseline"], early_runs[EARLY_PLAN]
    assert base["global_step"] == 32 and [s for s, _ in base["evals"]] == [8, 16, 24, 32]
    assert r["restored_step"] == 19
    assert (r["global_step"], r["evals"], r["lr"]) == (32, base["evals"], base["lr"])
    assert r["sha256"] == base["sha256"]


START_PLAN = "disk:11"  # a disk park after the evaluation before training and the one at step 8


@pytest.fixture(scope="module")
def start_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_all(JOB, tmp_path_factory.mktemp("hf-start"), [START_PLAN], env={"FW_HF_EVAL": "start"})


def test_disk_park_does_not_repeat_the_evaluation_before_training(start_runs: dict) -> None:
    """`eval_on_start` evaluates before the first step; the Trainer, resumed by gpuswap after a disk
    park, evaluated again before its first resumed step: a second entry in the log history (at
    the restored step) that an uninterrupted run never has. The resumed train() now skips it."""
    base, r = start_runs["baseline"], start_runs[START_PLAN]
    assert [s for s, _ in base["evals"]] == [0, 8, 16, 24, 32, 36]
    assert r["restored_step"] == 11
    assert r["evals"] == base["evals"]
    assert (r["global_step"], r["epoch"], r["lr"]) == (36, 3.0, base["lr"])
    assert r["sha256"] == base["sha256"]


@pytest.mark.gpu
def test_fp16_on_a_gpu_parks_and_resumes_bitwise(tmp_path) -> None:
    """The same Trainer on CUDA with fp16=True (its GradScaler, whose scale is a CUDA tensor) and
    full_determinism: RAM then disk parks end bitwise equal to the uninterrupted run, at the same
    loss scale."""
    check_mixed_precision_on_gpu(JOB, tmp_path, {PLAN: 16, END: 23, SPILL: 10})
