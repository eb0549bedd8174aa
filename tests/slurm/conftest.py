"""A real single-node Slurm for the tests in this directory (see slurmctl.py)."""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from slurmctl import SlurmCluster, why_not_available  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    why = why_not_available()
    if why is None and os.geteuid() != 0:
        why = "the private Slurm's daemons run as root; run the tests as root"
    if why is not None:
        warnings.warn(f"SKIPPING the real-Slurm tests: {why}")
        pytest.skip(f"SKIPPING the real-Slurm tests: {why}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
