"""The systemd unit shipped in the package (gpuswap/deploy/gpuswap.service) and `gpuswap service
install`. That a SIGTERM to the daemon alone leaves jobs running is tests/node/test_as_a_service.py."""
from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10
    import tomli as tomllib

from gpuswap.cli import service

ROOT = Path(__file__).resolve().parents[2]


def directives(text: str) -> dict[str, list[str]]:
    """KEY -> its values, from the lines that are not comments."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuswap.cli.main", "service", "install", *args],
                          capture_output=True, text=True, timeout=120)


def test_the_unit_stops_the_daemon_alone_and_never_its_jobs():
    d = directives(service.template())
    assert d["KillMode"] == ["process"]           # control-group or mixed would kill users' jobs
    assert d["OOMPolicy"] == ["continue"]         # a job's OOM kill must not stop the service
    assert d["TasksMax"] == ["infinity"] and d["LimitMEMLOCK"] == ["infinity"]
    assert d["RestartPreventExitStatus"] == ["64"] and d["Restart"] == ["on-failure"]
    assert d["Environment"] == ["GPUSWAP_HOME=/var/lib/gpuswap", "PYTHONUNBUFFERED=1"]
    assert len(d["ExecStart"]) == 1 and d["ExecStart"][0].endswith(" server")
    # Each of these would confine users' jobs too (they descend from the daemon): the unit says
    # why in a comment, and sets none of them.
    for confining in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                      "DevicePolicy", "MemoryDenyWriteExecute", "SystemCallFilter", "RestrictNamespaces",
                      "CapabilityBoundingSet", "User", "DynamicUser"):
        assert confining not in d, confining
        if confining not in ("User", "DynamicUser"):
            assert confining in service.template(), f"the unit's comments should say why {confining} is off"


def test_the_unit_is_package_data():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gpuswap"]
    assert any(fnmatch.fnmatch("deploy/gpuswap.service", p) for p in patterns), patterns


def test_install_print_points_execstart_at_this_gpuswap():
    r = install("--print")
    assert r.returncode == 0, r.stderr
    d = directives(r.stdout)
    assert d["ExecStart"] == [f"{Path(sys.executable).absolute()} -m gpuswap.cli.main server"]
    assert d["KillMode"] == ["process"]


def test_install_writes_once_and_never_overwrites_local_changes_unasked(tmp_path):
    path = tmp_path / "gpuswap.service"
    r = install("--path", str(path))
    assert r.returncode == 0 and "systemctl daemon-reload && sudo systemctl enable --now gpuswap" in r.stdout, r
    assert path.read_text() == install("--print").stdout and (path.stat().st_mode & 0o777) == 0o644
    assert install("--path", str(path)).stdout.startswith(f"{path} is already this unit")
    path.write_text(path.read_text() + "# a local change\n")
    r = install("--path", str(path))
    assert r.returncode == 1 and "exists and differs" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert path.read_text().endswith("# a local change\n")
    assert install("--path", str(path), "--force").returncode == 0
    assert path.read_text() == install("--print").stdout


def test_an_unwritable_target_is_one_line(tmp_path):
    r = install("--path", str(tmp_path / "no" / "such" / "dir" / "gpuswap.service"))
    assert r.returncode == 1 and r.stderr.startswith("gpuswap: cannot write ") and r.stderr.count("\n") == 1


def test_exec_words_are_quoted_for_systemd():
    assert service.exec_quote("/opt/gpuswap/bin/gpuswap") == "/opt/gpuswap/bin/gpuswap"
    assert service.exec_quote("/opt/my env/bin/python") == '"/opt/my env/bin/python"'
    assert service.exec_quote("/opt/100%/$HOME") == "/opt/100%%/$$HOME"
    unit = service.unit(["/opt/my env/bin/python", "-m", "gpuswap.cli.main"])
    assert 'ExecStart="/opt/my env/bin/python" -m gpuswap.cli.main server\n' in unit


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_accepts_the_unit(tmp_path):
    path = tmp_path / "gpuswap.service"
    path.write_text(install("--print").stdout)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SYSTEMD_LOG_LEVEL="warning"))
    # Only the unit's own problems count: verify also reports the host's units it pulls in.
    own = [line for line in (r.stdout + r.stderr).splitlines() if "gpuswap.service" in line]
    assert r.returncode == 0 and not own, r.stdout + r.stderr
