"""Values no job could use are refused with a 4xx and one clear sentence, never a 500 (issue 10
item 9): sizes beyond any float, strings SQLite cannot store or exec cannot pass (lone surrogates,
NUL, '=' in a variable's name); and a full disk is a 507 that changes nothing."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from gpuswap_testing import Daemon, train_cmd

NINES = "9" * 400
OK = '"argv": ["true"], "cwd": "/"'
BAD = {
    "mem of 400 nines": f'{{{OK}, "mem": "{NINES}"}}',
    "mem 10**400 as a JSON integer": f'{{{OK}, "mem": 1{"0" * 400}}}',
    "mem of 308 digits and GiB": f'{{{OK}, "mem": "{"9" * 308}GiB"}}',
    "mem of 5000 digits": f'{{{OK}, "mem": {"9" * 5000}}}',
    "mem 1e400": f'{{{OK}, "mem": 1e400}}',
    "argv with a lone surrogate": r'{"argv": ["\ud800"], "cwd": "/"}',
    "argv with a NUL": r'{"argv": ["tr\u0000ue"], "cwd": "/"}',
    "cwd with a lone surrogate": r'{"argv": ["true"], "cwd": "/tmp/\udfff"}',
    "name with a lone surrogate": r'{"argv": ["true"], "cwd": "/", "name": "x\ud800"}',
    "env name with a lone surrogate": r'{"argv": ["true"], "cwd": "/", "env": {"\ud800": "1"}}',
    "env value with a lone surrogate": r'{"argv": ["true"], "cwd": "/", "env": {"A": "\udc00"}}',
    "env name with '='": r'{"argv": ["true"], "cwd": "/", "env": {"A=B": "1"}}',
    "empty env name": r'{"argv": ["true"], "cwd": "/", "env": {"": "1"}}',
}


def http(home: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(home / "gpuswap.sock")), base_url="http://x",
                        timeout=60)


def test_unusable_values_are_4xx_with_a_clear_sentence(daemon):
    with http(daemon.home) as c:
        for what, body in BAD.items():
            r = c.post("/v1/jobs", content=body.encode(), headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (what, r.status_code, r.text[:300])
            detail = r.json()["detail"]
            assert isinstance(detail, str) and detail and "\n" not in detail and len(detail) < 400, (what, detail)
        assert c.get("/v1/jobs").json() == []          # nothing was recorded
        assert c.get("/v1/health").json()["ok"]
    out = (daemon.home / "daemon.out").read_text()
    assert "Traceback" not in out and " 500 " not in out, out


def test_a_value_that_is_not_utf8_is_named(daemon, tmp_path):
    """The CLI sends the user's whole environment: one variable holding a byte that is not UTF-8
    refuses every submit, so the refusal names it (and the argument, or the working directory)."""
    def submit(*argv: bytes, cwd: Path = daemon.home, **env: bytes) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable.encode(), b"-m", b"gpuswap.cli.main", b"submit", b"--", *argv],
                              env={**daemon.env, **env}, cwd=cwd, capture_output=True, text=True, timeout=120)

    odd = tmp_path / os.fsdecode(b"dir\xff")
    odd.mkdir()
    for r, says in ((submit(b"true", GS_ODD_VARIABLE=b"a\xffb"), "environment variable 'GS_ODD_VARIABLE'"),
                    (submit(b"true", b"x", b"\xfe"), "argv[2]"),
                    (submit(b"true", cwd=odd), "the working directory")):
        assert r.returncode == 64 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r
        assert f"{says} is not valid UTF-8 text" in r.stderr, r.stderr
    assert daemon.client.get("/v1/jobs") == []


def test_cli_refuses_a_size_beyond_any_gpu(daemon):
    r = daemon.cli("submit", "--mem", NINES, "--", "true")
    assert r.returncode == 64 and "too large" in r.stderr and "Traceback" not in r.stderr, r


def _fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 512):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)


@pytest.fixture
def tmpfs():
    """Mount a tmpfs of a given size (`tmpfs("16m")`), so a disk can really be filled."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = Path(tempfile.mkdtemp(prefix="gs-full-", dir="/tmp"))
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            mnt.rmdir()
            pytest.skip(f"cannot mount a small tmpfs to fill (needs root and mount rights): {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["pkill", "-9", "-f", str(mnt)], check=False)
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        mnt.rmdir()


@pytest.fixture
def small_disk(tmpfs):
    """A 16 MiB tmpfs for GPUSWAP_HOME."""
    return tmpfs("16m")


def test_submit_and_resume_on_a_full_disk_are_507_and_change_nothing(small_disk):
    d = Daemon(small_disk, ["--simulate-gpus", "1x80GiB", "--min-runtime", "1", "--max-switch-fraction", "1"])
    d.start()
    try:
        job = d.submit(train_cmd(Path("/tmp") / f"{small_disk.name}.json", steps=100_000, step_time=0.02))
        d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
        d.client.post(f"/v1/jobs/{job}/pause", {"to": "ram"})
        d.until(job, lambda j: j["state"] == "PAUSED" and j["held"])
        filler = small_disk / "filler"
        _fill(filler)
        with http(small_disk) as c:
            # Near the size limits (docs/limits.md: one string 128 KiB, env 256 KiB in all): more than
            # the room SQLite's WAL already holds.
            big_env = {"PAD": "x" * (120 << 10), "PAD2": "y" * (120 << 10)}
            r = c.post("/v1/jobs", json={"argv": ["true"], "cwd": "/", "env": big_env})
            assert r.status_code == 507, (r.status_code, r.text)
            assert "disk is full" in r.json()["detail"], r.text
            # Fill whatever the refused insert left free, then the small write of a resume fails too.
            _fill(small_disk / "filler2")
            r = c.post(f"/v1/jobs/{job}/resume")
            assert r.status_code == 507, (r.status_code, r.text)
            assert d.job(job)["held"] and d.job(job)["state"] == "PAUSED"   # nothing changed
            assert len(c.get("/v1/jobs").json()) == 1
            filler.unlink()
            (small_disk / "filler2").unlink()
            assert c.post(f"/v1/jobs/{job}/resume").status_code == 200
            d.state(job, "RUNNING")
            assert c.post("/v1/jobs", json={"argv": ["true"], "cwd": "/", "env": big_env}).status_code == 201
        assert d.proc.poll() is None
        assert not list(small_disk.rglob(".*.tmp")), list(small_disk.rglob(".*.tmp"))
    finally:
        d.stop()


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temp_file(small_disk):
    from gpuswap.fsutil import atomic_write_bytes

    target = small_disk / "status.json"
    atomic_write_bytes(target, b'{"old": true}')
    _fill(small_disk / "filler")
    with pytest.raises(OSError) as e:
        atomic_write_bytes(target, b"x" * (1 << 20))
    assert e.value.errno == errno.ENOSPC
    assert target.read_bytes() == b'{"old": true}'
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "status.json"]


def test_the_disk_calibration_never_fills_the_home(tmpfs):
    """It writes at most a tenth of what is free (bandwidth.py): on a 16 MiB home it wrote until
    ENOSPC, and the daemon starting there died of its own full disk before its first line."""
    from gpuswap.node.bandwidth import Bandwidths

    small = Bandwidths()
    small.calibrate(tmpfs("16m"), simulated=True)              # 1.6 MiB would measure nothing
    assert small.describe()["disk_write_bps"]["source"] == "default"
    roomy = Bandwidths()
    roomy.calibrate(tmpfs("200m"), simulated=True)
    assert roomy.describe()["disk_write_bps"]["source"] == "calibrated: 20 MiB write+fsync in the home"
    assert roomy.describe()["disk_read_bps"]["source"] == "calibrated: 20 MiB read in the home"


def test_a_daemon_whose_output_cannot_be_written_serves(home):
    """stdout and stderr on /dev/full (every write is ENOSPC), calibration on: it comes up, serves
    and stops cleanly, with nothing to say."""
    from gpuswap.api.client import Client, ClientError

    env = dict({k: v for k, v in os.environ.items() if k != "GPUSWAP_CONFIG"}, GPUSWAP_HOME=str(home))
    with open("/dev/full", "wb") as full:
        proc = subprocess.Popen([sys.executable, "-m", "gpuswap.cli.main", "server", "--simulate-gpus", "1x80GiB"],
                                env=env, stdout=full, stderr=full)
    try:
        client, deadline = Client(home, timeout=60), time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
            try:
                assert client.get("/v1/health")["ok"]
                break
            except ClientError:
                assert time.monotonic() < deadline, "the daemon never answered"
                time.sleep(0.05)
        assert client.get("/v1/jobs") == []
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, proc.returncode
