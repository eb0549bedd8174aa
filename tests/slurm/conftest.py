"""A real single-node Slurm for the tests in this directory (see slurmctl.py)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from slurmctl import SlurmCluster, ensure_installed  # noqa: E402


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    why = ensure_installed()
    if why is not None:
        warnings.warn(f"SKIPPING the real-Slurm tests: {why}")
        pytest.skip(f"SKIPPING the real-Slurm tests: {why}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
