"""Lightning's SafepointCallback with a real Trainer on CPU: parked to RAM, then to disk (the
process exits 75, a new one restores the trainer's own state), the fit ends bitwise equal to an
uninterrupted one and trains on the same batches in the same order."""
from __future__ import annotations

import pytest

from fw_runner import _start, check_mixed_precision_on_gpu, require, run_all

require("lightning", "lightning")

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

JOB = "lightning_job.py"  # 3 epochs x 12 batches; shuffled loader, dropout, AdamW, StepLR per step
MID, END = "ram:10,disk:16", "disk:23"  # step 16: mid-epoch 1; step 23: last batch of epoch 1
SPILL = "spill:10"  # parked in RAM at step 10, then written to disk from the host copies


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    r = run_all(JOB, tmp_path_factory.mktemp("lightning"), [MID, END, SPILL])
    assert r["baseline"]["global_step"] == 36 and r["baseline"]["restored_step"] is None
    return r


@pytest.mark.parametrize("plan,pause_at", [(MID, 16), (END, 23)], ids=["ram+disk-mid-epoch", "disk-epoch-end"])
def test_park_and_resume_is_bitwise_exact(runs: dict, plan: str, pause_at: int) -> None:
    base, r = runs["baseline"], runs[plan]
    assert r["restored_step"] == pause_at
    if "ram" in plan:  # the RAM park before the disk park really released the memory
        assert r["parked_bytes"] and r["parked_bytes"][0] > 0
    assert (r["global_step"], r["epoch"], r["lr"]) == (36, 3, base["lr"])  # loops + scheduler
    # the restarted process trained on exactly the batches the uninterrupted run had left
    assert r["batches"] == base["batches"][pause_at + 1:]
    assert r["sha256"] == base["sha256"]


def test_a_spill_exits_75_and_resumes_bitwise(runs: dict) -> None:
    """Parked in RAM at step 10, spilled to disk: Lightning's teardown (the optimizer state moved
    to the CPU) found its tensors whole, the process exited 75, the restart ends bitwise."""
    base, r = runs["baseline"], runs[SPILL]
    assert r["restored_step"] == 10        # (its parked_bytes came after the payload the RAM park took)
    assert r["batches"] == base["batches"][11:] and r["sha256"] == base["sha256"]


def test_a_spill_that_leaves_freed_tensors_fails_the_teardown_as_on_an_h100(tmp_path) -> None:
    """Mutation check of the simulated GPU (runtime/freedguard.py): with parking.leave_on_host a
    no-op, Lightning's teardown `.to("cpu")` of a freed optimizer tensor fails with "CUDA error:
    invalid argument" and the job exits 1, as it did on an H100; before the guard it exited 75."""
    proc = _start(JOB, tmp_path / "out.json", tmp_path / "ckpt", SPILL, {"FW_KEEP_FREED": "1"})
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err[-5000:]
    assert "RuntimeError: CUDA error: invalid argument" in err and "_optimizers_to_device" in err, err[-5000:]


@pytest.mark.gpu
def test_mixed_precision_on_a_gpu_parks_and_resumes_bitwise(tmp_path) -> None:
    """The same fit on CUDA in 16-bit mixed precision: the GradScaler's scale (a CUDA tensor) and
    its growth tracker are parked and restored with the rest, so RAM and disk parks end bitwise
    equal to the uninterrupted fit, at the same loss scale."""
    check_mixed_precision_on_gpu(JOB, tmp_path, {MID: 16, END: 23, SPILL: 10})
