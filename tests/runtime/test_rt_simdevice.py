"""On simulated GPUs the runtime's process is a simulated CUDA process, as a real one is: it holds a
context floor plus its attached bytes; a RAM park leaves exactly the floor (a park cannot free
it); a resume puts the attached bytes back (runtime/simdevice.py, issue 12 bug 5)."""
from __future__ import annotations

import gc
import os

import pytest
import torch

import gpuswap
from gpuswap import simcuda
from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR
from gpuswap.runtime import simdevice
from gpuswap_rt_peer import pause_in_background

FLOOR = 3 * 2**20


@pytest.fixture
def device(monkeypatch, tmp_path, sim_env):
    monkeypatch.setenv(SIM_CUDA_DIR, str(tmp_path / "sim"))
    monkeypatch.setenv(SIM_CONTEXT_BYTES, str(FLOOR))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    for name in ("_registered", "_pid", "_reg"):                  # a fresh process, as far as the module knows
        monkeypatch.setattr(simdevice, name, None)
    dev = simcuda.SimDevice(tmp_path / "sim")
    dev.prepare()
    dev.describe([2**40, 2**40])           # what the daemon's simulated driver writes at start
    return dev


def _held(dev: simcuda.SimDevice) -> list[tuple[int, int, int]]:
    return [r for r in dev.resident() if r[0] == os.getpid()]


def test_attach_registers_the_floor_and_the_attached_bytes_a_ram_park_leaves_the_floor(device, peer):
    model = torch.nn.Linear(64, 64)
    job = gpuswap.attach(model=model)
    attached = job.device_bytes()
    assert attached > 0 and _held(device) == [(os.getpid(), 1, FLOOR + attached)]
    seen = pause_in_background(job, lambda: {"parked": _held(device)}, step=0)
    assert seen["parked"] == [(os.getpid(), 1, FLOOR)]          # the floor stays, nothing else
    assert _held(device) == [(os.getpid(), 1, FLOOR + attached)]  # back before `resumed` is sent
    job.close()


def test_a_job_spread_over_two_gpus_holds_a_context_on_each_and_a_ram_park_leaves_the_floor_on_each(
        device, peer, monkeypatch):
    """GPUSWAP_SIM_DEVICES says which simulated GPUs a job's tensors live on (runtime/simdevice.py):
    its bytes are spread over them, each holds the process's context, and a RAM park frees the
    attached bytes on each but leaves the context on both, as a real park does."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("GPUSWAP_SIM_DEVICES", "0,1")
    job = gpuswap.attach(model=torch.nn.Linear(64, 64))
    attached, me = job.device_bytes(), os.getpid()
    half, odd = divmod(attached, 2)
    assert sorted(_held(device)) == [(me, 0, FLOOR + half + odd), (me, 1, FLOOR + half)]
    seen = pause_in_background(job, lambda: {"parked": sorted(_held(device))}, step=0)
    assert seen["parked"] == [(me, 0, FLOOR), (me, 1, FLOOR)]
    assert sorted(_held(device)) == [(me, 0, FLOOR + half + odd), (me, 1, FLOOR + half)]
    job.close()


def test_nothing_is_registered_on_real_gpus_or_outside_a_daemons_simulated_gpus(device, monkeypatch):
    simdevice.hold(100, simulated=False)
    assert _held(device) == []
    monkeypatch.delenv(SIM_CUDA_DIR)
    simdevice.hold(100, simulated=True)
    assert _held(device) == []


def test_a_registration_blocks_while_the_driver_holds_the_process(device, monkeypatch):
    """A job frozen transparently is locked, then checkpointed, by the driver, and its CUDA calls
    block until the thaw (CUDA docs, cuCheckpointProcessLock): the runtime's registration of new
    bytes is one such call, so it waits and lands only once the process runs again."""
    import threading
    import time
    from types import SimpleNamespace

    from gpuswap.node.gpus import SimulatedGpus
    from gpuswap.node.simdriver import SimulatedCheckpointDriver

    driver = SimulatedCheckpointDriver(SimulatedGpus(2, 2**40, device), device)
    simdevice.hold(100, simulated=True)
    me = os.getpid()
    driver.lock(me, 1000)
    driver.checkpoint(me)
    waiting = threading.Event()

    def sleep(s: float) -> None:
        waiting.set()
        time.sleep(s)
    monkeypatch.setattr(simcuda, "time", SimpleNamespace(sleep=sleep))
    t = threading.Thread(target=simdevice.hold, args=(200, True))
    t.start()
    assert waiting.wait(60), "the registration did not wait for the thaw"
    assert device.registration(me).used == FLOOR + 100 and _held(device) == []     # checkpointed: not listed
    driver.restore(me)
    driver.unlock(me)
    t.join(120)
    assert not t.is_alive() and _held(device) == [(me, 1, FLOOR + 200)]


def test_a_safepoint_blocks_while_the_driver_holds_the_process(device, peer, monkeypatch):
    """A real training step launches kernels, and while the driver holds the process those CUDA
    calls block (CUDA docs, cuCheckpointProcessLock: "block further CUDA API calls"): a job locked
    by a transparent freeze reaches no safepoint, so serves no pause and steps no further, until it
    is unlocked. The simulated job kept stepping on its CPU tensors (only a changed registration
    blocked); its safepoint now makes the step's CUDA call (simdevice.step)."""
    import threading
    import time
    from types import SimpleNamespace

    from gpuswap.node.gpus import SimulatedGpus
    from gpuswap.node.simdriver import SimulatedCheckpointDriver

    driver = SimulatedCheckpointDriver(SimulatedGpus(2, 2**40, device), device)
    job = gpuswap.attach(model=torch.nn.Linear(8, 8))
    job.safepoint(1)                          # running: returns at once
    me = os.getpid()
    driver.lock(me, 1000)
    waiting = threading.Event()

    def sleep(s: float) -> None:
        waiting.set()
        time.sleep(s)
    monkeypatch.setattr(simcuda, "time", SimpleNamespace(sleep=sleep))
    t = threading.Thread(target=job.safepoint, args=(2,))
    t.start()
    deadline = time.monotonic() + 60
    while not waiting.is_set() and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting.is_set() and t.is_alive(), "a safepoint of a locked process did not block"
    assert job.step == 1                      # the step did not complete
    driver.unlock(me)
    t.join(60)
    assert not t.is_alive() and job.step == 2
    job.close()


def test_the_floor_is_chosen_by_the_environment_and_a_bad_value_falls_back(capsys):
    assert simdevice.context_bytes({}) == simdevice.DEFAULT_CONTEXT_BYTES == 512 * 2**20
    assert simdevice.context_bytes({SIM_CONTEXT_BYTES: "256MiB"}) == 256 * 2**20
    assert simdevice.context_bytes({SIM_CONTEXT_BYTES: "lots"}) == simdevice.DEFAULT_CONTEXT_BYTES
    assert "ignoring GPUSWAP_SIM_CONTEXT_BYTES" in capsys.readouterr().err


def test_a_one_process_ddp_keeps_its_bucket_buffers_through_a_park_and_the_simulated_gpu_counts_them(
        device, peer, tmp_path):
    """A DDP of world size 1 under the single-process handle: its Reducer's flat bucket buffers
    (one more copy of the gradients, runtime/ddpreducer.py) are not attached tensors and this
    park does not free them; a real GPU would list them in NVML, and so does the simulated one."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no torch.distributed with gloo")
    gc.collect()    # DDPs an earlier test in this process left unreachable are gone: only this one holds buckets
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
        model(torch.randn(2, 64)).sum().backward()
        buckets = sum(p.numel() * p.element_size() for p in model.parameters())
        job = gpuswap.attach(model=model)
        attached = job.device_bytes()
        assert _held(device) == [(os.getpid(), 1, FLOOR + attached + buckets)]
        seen = pause_in_background(job, lambda: {"parked": _held(device)}, step=0)
        assert seen["parked"] == [(os.getpid(), 1, FLOOR + buckets)]      # what a real GPU would keep
        assert _held(device) == [(os.getpid(), 1, FLOOR + attached + buckets)]
        job.close()
    finally:
        dist.destroy_process_group()


def test_attach_on_a_full_simulated_gpu_raises_torchs_out_of_memory_error(device, peer):
    """The attached bytes are the job's device memory: on a GPU without room for them the job
    fails with torch's own error, as its real `.to("cuda")` would (simcuda, strict about room)."""
    device.describe([2**40, FLOOR + 100])
    with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate") as e:
        gpuswap.attach(model=torch.nn.Linear(64, 64))
    assert isinstance(e.value.__cause__, simcuda.OutOfMemoryError)
    assert _held(device) == [(os.getpid(), 1, FLOOR)]     # the context was made; the tensors were not


def test_a_resume_onto_a_gpu_another_process_filled_fails_stays_parked_and_retries(device, peer, tmp_path):
    """While the job is parked in RAM another process takes the GPU's free memory: the resume's
    refill fails with torch's out-of-memory error, as parking.restore's would on a real GPU, the
    job reports it and stays parked (holding its floor only); once the memory is free again the
    next resume brings everything back."""
    import subprocess
    import sys
    import threading
    import time

    model = torch.nn.Linear(64, 64)
    job = gpuswap.attach(model=model)
    attached = job.device_bytes()
    device.describe([2**40, FLOOR + attached + FLOOR + attached])   # room for the job and one more like it
    ready = tmp_path / "filler-ready"
    seen: dict = {}

    def drive() -> None:
        deadline = time.monotonic() + 120
        job.request_pause("ram")
        while not job.parked:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        filler = subprocess.Popen([sys.executable, "-c",
                                   "import sys, time; from gpuswap import simcuda; "
                                   f"simcuda.allocate({attached + 1}); open(sys.argv[1], 'w').close(); time.sleep(3600)",
                                   str(ready)])
        try:
            while not ready.exists():
                assert filler.poll() is None and time.monotonic() < deadline, "the filler did not allocate"
                time.sleep(0.01)
            job.request_resume()
            while not any(m["op"] == "error" for m in peer.log):
                assert time.monotonic() < deadline, "no error for the failed resume"
                time.sleep(0.01)
            seen["error"] = next(m for m in peer.log if m["op"] == "error")["message"]
            seen["parked"], seen["held"] = job.parked, _held(device)
        finally:
            filler.kill()
            filler.wait()
        while any(pid == filler.pid for pid, _, _ in device.resident()):   # its registration dies with it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        job.request_resume()

    t = threading.Thread(target=drive)
    t.start()
    while job._phase == "running" and not job._pending:
        time.sleep(0.001)
    job.safepoint(0)                # returns once resumed
    t.join()
    assert seen["error"].startswith("resume from ram failed: OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert seen["parked"] and seen["held"] == [(os.getpid(), 1, FLOOR)]
    assert _held(device) == [(os.getpid(), 1, FLOOR + attached)]
    deadline = time.monotonic() + 60
    while not any(m["op"] == "resumed" for m in peer.log):      # sent before safepoint returned
        assert time.monotonic() < deadline, peer.log
        time.sleep(0.01)
    assert [m["op"] for m in peer.log if m["op"] in ("paused", "error", "resumed")] == ["paused", "error", "resumed"]
    job.close()
