"""A seeded sample of the fault-injection trial (tests/fault_trial.py): `kill -9` of the daemon
across job states, hostile requests and a hostile job; nothing may be lost, stuck, wrong or 5xx.
The longer run is `python tests/fault_trial.py --trials 40`."""
from __future__ import annotations

import pytest

import os

import fault_trial

pytestmark = pytest.mark.slow   # runs first (tests/conftest.py)

TRIALS = int(os.environ.get("GPUSWAP_FAULT_TRIALS", "4"))
SEED = int(os.environ.get("GPUSWAP_FAULT_SEED", "7"))


def test_seeded_fault_injection_loses_nothing(reference_hashes):
    # the same run as fault_trial.reference_hash (train_cmd, no step time, reference_env on the CPU)
    counts = fault_trial.run(TRIALS, SEED, log=print,
                             reference=reference_hashes(fault_trial.STEPS, fault_trial.HIDDEN))
    report = counts.table() + "\n" + "\n".join(counts.problems)
    assert counts.failures == 0, report
    assert counts.trials == TRIALS and counts.kills >= TRIALS, report   # every trial killed the daemon
