"""How the suite sets itself up. A test run never installs anything: where the Slurm or browser
tests' tools are absent, the check says which and how to get them (tests/setup-system.sh), and
runs no program to find out (absence is simulated by looking in an empty directory, not by
uninstalling). And `-n auto` picks a worker count that fits the machine."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "slurm"))

import slurmctl  # noqa: E402
import webtools  # noqa: E402


@pytest.fixture
def no_programs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a check ran a program: {args}")
    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)


def test_slurm_check_names_what_is_missing_and_installs_nothing(tmp_path, no_programs):
    why = slurmctl.why_not_available(path=str(tmp_path))
    assert why is not None
    for program in ("slurmctld", "slurmd", "munged", "sbatch"):
        assert program in why
    assert "tests/setup-system.sh" in why


def test_slurm_check_passes_where_the_programs_are(tmp_path, no_programs):
    for program in slurmctl.DAEMONS + slurmctl.CLIENTS:
        exe = tmp_path / program
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    assert slurmctl.why_not_available(path=str(tmp_path)) is None


def test_browser_check_names_what_is_missing_and_installs_nothing(tmp_path, no_programs):
    why = webtools.why_no_browser(str(tmp_path / "chromium"))
    assert why is not None and str(tmp_path / "chromium") in why and "tests/setup-system.sh" in why
    exe = tmp_path / "chromium"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert webtools.why_no_browser(str(exe)) is None


def test_no_test_module_runs_an_installer():
    """The install step lives in tests/setup-system.sh (run by .ci/run), not in any test module."""
    installers = ('"apt-get"', "'apt-get'", '"dpkg"', '"playwright", "install"')
    offenders = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*.py") if p != Path(__file__).resolve()
                 and any(word in p.read_text() for word in installers)]
    assert not offenders, offenders


def test_worker_count_fits_the_machine():
    from gpuswap_testing import auto_workers

    assert auto_workers(2, 0.0) == 4          # an idle 2-core machine
    assert auto_workers(2, 1.2) == 3          # just after the install step
    assert auto_workers(2, 2.0) == 2          # two CPU hogs already there: the floor
    assert auto_workers(2, 9.0) == 2
    assert auto_workers(4, 1.0) == 7
    assert auto_workers(64, 0.0) == 8         # the ceiling


def test_recorded_durations_sum_each_files_phases():
    """tests/record_durations.py reads a `--durations=0` report into seconds per file (the order
    tests/conftest.py hands files to the workers in): setup, call and teardown all count."""
    from record_durations import per_file

    report = """============================= slowest durations ==============================
30.40s setup    tests/frameworks/test_x.py::test_a[ram+disk-mid-epoch]
20.10s call     tests/node/test_y.py::test_b
12.00s call     tests/frameworks/test_x.py::test_c
0.60s teardown tests/node/test_y.py::test_b
0.20s call     tests/cli/test_z.py::test_d
=========================== short test summary info ============================"""
    assert per_file(report) == {"tests/frameworks/test_x.py": 42, "tests/node/test_y.py": 21}
    assert list(per_file(report)) == ["tests/frameworks/test_x.py", "tests/node/test_y.py"]   # longest first
