"""Switch-cost bandwidths: the pinned-copy calibration's driver calls (against an explicit test
double of cuda.bindings.driver), figures kept in SQLite across restarts, and, end to end, the
disk tier's read bandwidth learned from a real restore and still there after a daemon restart."""
from __future__ import annotations

import enum
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuswap.node.bandwidth import (PINNED_CALIBRATION_BYTES, Bandwidths, CudaUnavailable, disk_calibration_bytes,
                                    pinned_copy_bandwidth)
from gpuswap.node.store import Store
from gpuswap.policy.model import SwitchCosts
from gpuswap_testing import Gate


class CUresult(enum.Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100


class FakeCudaDriver:
    """Stands in for `cuda.bindings.driver`: same names, same return convention (a tuple whose
    first element is the CUresult), a call log, injectable failures, and copies that take a set
    time on its own clock (`clock`, given to the code under test), so the measured bandwidth is
    known exactly however loaded the machine is."""

    CUresult = CUresult

    def __init__(self, copy_s: float = 0.01, fail: dict[str, CUresult] | None = None):
        self.copy_s, self.fail, self.calls = copy_s, fail or {}, []
        self.live: set[str] = set()
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def _do(self, name: str, *result: Any) -> tuple[Any, ...]:
        self.calls.append(name)
        if name in self.fail:
            return (self.fail[name],) + (None,) * len(result)
        return (CUresult.CUDA_SUCCESS,) + result

    def cuInit(self, flags: int): return self._do("cuInit")
    def cuDeviceGet(self, ordinal: int): return self._do("cuDeviceGet", f"dev{ordinal}")

    def cuDevicePrimaryCtxRetain(self, dev: str):
        self.live.add("ctx")
        return self._do("cuDevicePrimaryCtxRetain", "ctx")

    def cuDevicePrimaryCtxRelease(self, dev: str):
        self.live.discard("ctx")
        return self._do("cuDevicePrimaryCtxRelease")

    def cuCtxPushCurrent(self, ctx: str): return self._do("cuCtxPushCurrent")
    def cuCtxPopCurrent(self): return self._do("cuCtxPopCurrent", "ctx")
    def cuCtxSynchronize(self): return self._do("cuCtxSynchronize")

    def cuMemHostAlloc(self, nbytes: int, flags: int):
        r = self._do("cuMemHostAlloc", 0x7F000000)
        if r[0] == CUresult.CUDA_SUCCESS:
            self.live.add("host")
        return r

    def cuMemAlloc(self, nbytes: int):
        r = self._do("cuMemAlloc", 0xD000)
        if r[0] == CUresult.CUDA_SUCCESS:
            self.live.add("device")
        return r

    def cuMemFree(self, dptr: int):
        self.live.discard("device")
        return self._do("cuMemFree")

    def cuMemFreeHost(self, ptr: int):
        self.live.discard("host")
        return self._do("cuMemFreeHost")

    def cuMemcpyHtoD(self, dst: int, src: int, nbytes: int):
        self.now += self.copy_s
        return self._do("cuMemcpyHtoD")

    def cuMemcpyDtoH(self, dst: int, src: int, nbytes: int):
        self.now += self.copy_s * 2
        return self._do("cuMemcpyDtoH")


def test_pinned_copy_calibration_times_both_directions_and_releases_everything():
    fake = FakeCudaDriver(copy_s=0.01)
    park, resume = pinned_copy_bandwidth(fake, clock=fake.clock)
    # device->host copies take twice as long in the double: half the bandwidth
    assert park == pytest.approx(PINNED_CALIBRATION_BYTES / 0.02)
    assert resume == pytest.approx(PINNED_CALIBRATION_BYTES / 0.01)
    assert fake.calls[:6] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent",
                              "cuMemHostAlloc", "cuMemAlloc"]
    assert fake.calls[-4:] == ["cuMemFree", "cuMemFreeHost", "cuCtxPopCurrent", "cuDevicePrimaryCtxRelease"]
    assert fake.calls.count("cuMemcpyHtoD") == fake.calls.count("cuMemcpyDtoH") == 3
    assert not fake.live                    # the daemon keeps no GPU memory and no context


def test_a_failed_allocation_frees_what_it_got_and_keeps_the_figures(tmp_path):
    fake = FakeCudaDriver(fail={"cuMemAlloc": CUresult.CUDA_ERROR_OUT_OF_MEMORY})
    with pytest.raises(CudaUnavailable, match="cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY"):
        pinned_copy_bandwidth(fake)
    assert not fake.live and "cuMemcpyHtoD" not in fake.calls

    bw = Bandwidths()
    bw.calibrate(tmp_path, simulated=False, cuda=fake, clock=fake.clock)   # never raises: the figures stay
    d = bw.describe()
    assert d["ram_park_bps"]["source"] == "default" and d["ram_park_bps"]["bytes_per_s"] == SwitchCosts().ram_park_bps
    assert d["disk_write_bps"]["source"].startswith("calibrated")


def test_real_gpu_calibration_through_the_double_sets_calibrated_ram_figures(tmp_path):
    bw = Bandwidths()
    fake = FakeCudaDriver(copy_s=0.01)
    bw.calibrate(tmp_path, simulated=False, cuda=fake, clock=fake.clock)
    d = bw.describe()
    assert d["ram_park_bps"]["source"] == "calibrated: pinned device->host copy of 256 MiB"
    assert d["ram_resume_bps"]["source"] == "calibrated: pinned host->device copy of 256 MiB"
    assert d["ram_resume_bps"]["bytes_per_s"] > d["ram_park_bps"]["bytes_per_s"]


def test_without_cuda_bindings_the_ram_figures_stay(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)      # `import cuda...` fails as if not installed
    with pytest.raises(CudaUnavailable, match="cuda-bindings"):
        pinned_copy_bandwidth()
    bw = Bandwidths()
    bw.calibrate(tmp_path, simulated=False)
    assert bw.describe()["ram_resume_bps"]["source"] == "default"


def test_learned_figures_survive_a_restart_and_beat_calibration(tmp_path):
    store = Store(tmp_path / "state.db")
    bw = Bandwidths(store)
    bw.observe("disk_read_bps", 64 * 2**20, 0.5)
    bw.observe("disk_read_bps", 64 * 2**20, 0.25)
    bw.observe("ram_park_bps", 2**20, 0.001)             # too small to say anything: ignored
    value = bw.describe()["disk_read_bps"]["bytes_per_s"]
    assert bw.describe()["disk_read_bps"]["source"] == "measured: 2 real move(s)"
    store.close()

    again = Bandwidths(Store(tmp_path / "state.db"))
    again.calibrate(tmp_path, simulated=True)
    d = again.describe()
    assert d["disk_read_bps"] == {"bytes_per_s": value, "samples": 2,
                                  "source": "learned: 2 real move(s) before the last restart"}
    assert d["ram_park_bps"]["source"].startswith("calibrated")
    again.observe("disk_read_bps", 64 * 2**20, 0.5)
    assert again.describe()["disk_read_bps"]["source"] == "measured: 3 real move(s)"


def test_multi_rank_group_seconds_are_learned_kept_and_bounded(tmp_path):
    store = Store(tmp_path / "state.db")
    bw = Bandwidths(store)
    assert bw.describe()["group_rebuild_s"] == {"seconds": 5.0, "source": "default", "samples": 0}
    bw.observe_seconds("group_rebuild_s", 2.0)
    bw.observe_seconds("group_rebuild_s", 1.0)
    for bad in (None, -1.0, float("nan"), 7200.0, True):   # absent, impossible or a broken clock
        bw.observe_seconds("group_rebuild_s", bad)
    d = bw.describe()["group_rebuild_s"]
    assert d["samples"] == 2 and d["seconds"] == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)
    assert bw.costs().group_rebuild_s == pytest.approx(d["seconds"])
    assert bw.costs().group_teardown_s == 1.0               # still SwitchCosts' default
    store.close()
    again = Bandwidths(Store(tmp_path / "state.db"))
    assert again.describe()["group_rebuild_s"]["source"] == "learned: 2 real move(s) before the last restart"
    assert again.costs().group_rebuild_s == pytest.approx(d["seconds"])


@pytest.mark.gpu
def test_pinned_copy_calibration_on_a_real_gpu():
    pytest.importorskip("cuda.bindings")
    park, resume = pinned_copy_bandwidth()
    assert park > 1e9 and resume > 1e9       # PCIe/NVLink pinned copies: gigabytes per second


def test_disk_restore_teaches_read_bandwidth_and_a_restart_keeps_it(make_daemon, home):
    """A real disk park and restore (a ~24 MB checkpoint): the job's runtime times the restore,
    the daemon folds it into disk_read_bps, says so in the event, and remembers it after a restart."""
    d = make_daemon(calibrate=True)
    gate = Gate(home / "go")     # never opened: the job is cancelled, it must not end before that
    # Held from step 5 (AdamW state exists by then): it would otherwise train this 2M-parameter
    # model all through the test, seconds of CPU that nothing looks at.
    job = d.submit(gate.train(home / "r.json", 400, 0.02, hidden=1400, hold_at=5), name="r")
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"] and (j["step"] or 0) >= 3)
    assert d.cli("pause", str(job), "--to", "disk").returncode == 0
    d.until(job, lambda j: j["state"] == "PAUSED" and j["parked"] == "disk")
    assert d.cli("resume", str(job)).returncode == 0
    j = d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"], timeout=60)
    restart = [e["reason"] for e in j["events"] if e["reason"].startswith("restarted from its disk checkpoint")]
    assert restart and " read in " in restart[0], j["events"]
    bw = d.client.get("/v1/gpus")["bandwidths"]
    assert bw["disk_read_bps"]["source"] == "measured: 1 real move(s)", bw
    assert bw["disk_write_bps"]["source"] == "measured: 1 real move(s)", bw
    d.cli("cancel", str(job))
    d.state(job, "CANCELLED", timeout=30)
    d.stop()
    d.start()
    after = d.client.get("/v1/gpus")["bandwidths"]
    for field in ("disk_read_bps", "disk_write_bps"):
        assert after[field]["bytes_per_s"] == bw[field]["bytes_per_s"]
        assert after[field]["source"] == "learned: 1 real move(s) before the last restart"
    deadline = time.monotonic() + 180     # the RAM tier's calibration runs off the start path
    while not d.client.get("/v1/gpus")["bandwidths"]["ram_park_bps"]["source"].startswith("calibrated"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    shown = d.cli("gpus").stdout
    assert "(learned: 1 real move(s)" in shown and "(calibrated: host memcpy, simulated GPU)" in shown, shown


def test_a_job_that_lies_about_its_speed_teaches_no_bandwidth(make_daemon, home):
    """A park of 8 GiB "in 1 microsecond" (8.6 PB/s) is a lie: folded in, every later switch would
    look free to the policy. It is ignored, and the figures keep their source."""
    import liar_job

    d = make_daemon("--simulate-gpus", "1x80GiB", "--ram-budget", "64GiB")
    job = d.submit([sys.executable, str(Path(__file__).parent / "liar_job.py")], name="liar")
    d.until(job, lambda j: j["state"] == "RUNNING" and j["runtime_attached"])
    before = d.client.get("/v1/gpus")["bandwidths"]
    assert d.cli("pause", str(job), "--to", "ram").returncode == 0
    parked = d.state(job, "PAUSED")
    assert parked["parked_bytes"] == liar_job.LIE_BYTES, parked     # the lie reached the record...
    assert d.cli("resume", str(job)).returncode == 0
    d.state(job, "RUNNING")
    after = d.client.get("/v1/gpus")["bandwidths"]
    for field in ("ram_park_bps", "ram_resume_bps"):                 # ...but taught nothing
        assert after[field] == before[field], (field, before[field], after[field])
    assert d.cli("cancel", str(job)).returncode == 0
    d.state(job, "CANCELLED")


def test_the_disk_calibration_writes_a_tenth_of_the_free_room_at_most():
    MiB = 2**20
    assert disk_calibration_bytes(100 * 2**30) == 128 * MiB
    assert disk_calibration_bytes(1280 * MiB) == 128 * MiB
    assert disk_calibration_bytes(1000 * MiB) == 100 * MiB       # whole 4 MiB blocks
    assert disk_calibration_bytes(999 * MiB) == 96 * MiB
    assert disk_calibration_bytes(160 * MiB) == 16 * MiB
    assert disk_calibration_bytes(159 * MiB) == 0               # too little to measure a bandwidth
    assert disk_calibration_bytes(0) == 0
