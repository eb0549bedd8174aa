"""No starvation of wide jobs, live (issue 15, item 2): a real daemon on simulated GPUs, the issue's
case -- a 2-GPU normal job waits while a later 1-GPU low job could take the GPU it needs. With a
reservation (`--reserve-after`) the later job waits and the wide job starts as soon as its GPUs
are free; without one the later job is started into them. Every wait is on a state or a reason."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

from gpuswap.protocol import env as envvars
from gpuswap_testing import Gate


@pytest.mark.parametrize("reserve_after", ["0", "never"])
def test_wide_job_starts_once_its_reservation_forms(make_daemon, tmp_path, reserve_after):
    d = make_daemon("--simulate-gpus", "2x80GiB", "--min-runtime", "1", "--reserve-after", reserve_after)
    first, later = Gate(tmp_path / "first"), Gate(tmp_path / "later")
    try:
        # Holds one GPU and may not be paused: the wide job can only have it when it ends.
        l1 = d.submit(first.hold(), name="l1", priority="low", preemptible=False)
        d.state(l1, "RUNNING")
        wide = d.submit(later.hold(), name="wide", priority="normal", gpus=2)
        d.until(wide, lambda j: j["pending_reason"] is not None)
        l2 = d.submit(later.hold(), name="l2", priority="low")
        if reserve_after == "never":
            d.state(l2, "RUNNING")          # backfill with no reservation: into the wide job's GPU
            assert d.job(wide)["state"] == "PENDING"
            return
        j = d.until(l2, lambda j: j["pending_reason"] is not None or j["state"] != "PENDING")
        assert j["state"] == "PENDING" and j["pending_reason"] == "Reserved", j
        assert f"reserved for job {wide}" in j["pending_reason_text"], j["pending_reason_text"]
        w = d.job(wide)
        assert w["pending_reason"] == "Reserved" and "holds a reservation" in w["pending_reason_text"], w
        shown = d.cli("show", str(wide))
        assert shown.returncode == 0 and "holds a reservation" in " ".join(shown.stdout.split()), shown.stdout
        first.open()                        # l1 ends: both GPUs are the wide job's
        d.state(wide, "RUNNING")
        assert d.job(l2)["state"] == "PENDING"
        assert d.job(l1)["state"] == "COMPLETED"
    finally:
        first.open()
        later.open()


def _server(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != envvars.CONFIG} | {"GPUSWAP_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "server", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_reserve_after_is_a_setting_and_bad_values_are_refused(tmp_path):
    r = _server("--print-config", home=tmp_path / "h")
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout)["reserve-after"] == "10m"
    conf = tmp_path / "g.toml"
    conf.write_text('reserve-after = "never"\n')
    conf.chmod(0o644)
    r = _server("--config", str(conf), "--print-config", home=tmp_path / "h")
    assert r.returncode == 0 and tomllib.loads(r.stdout)["reserve-after"] == "never", r.stderr
    r = _server("--config", str(conf), "--reserve-after", "90", "--print-config", home=tmp_path / "h")
    assert r.returncode == 0 and tomllib.loads(r.stdout)["reserve-after"] == 90.0, r.stderr
    for bad in ("-5", "soon", "nan"):
        r = _server("--reserve-after", bad, "--print-config", home=tmp_path / "h")
        assert r.returncode == 64 and "reserve-after" in r.stderr and r.stderr.count("\n") == 1, (bad, r.stderr)
