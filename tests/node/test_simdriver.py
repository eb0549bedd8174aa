"""The simulated checkpoint driver and device, call by call, against real processes: each rule is
one the real driver shows (node/simdriver.py and docs/transparent.md give the sources). The daemon's
own use of them is in test_transparent_e2e.py."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator, Optional

import pytest

from gpuswap import simcuda
from gpuswap.node import simdriver
from gpuswap.node.cuda_ckpt import CHECKPOINTED, LOCKED, RUNNING, CheckpointError
from gpuswap.node.gpus import SimulatedGpus
from gpuswap.node.simdriver import SimulatedCheckpointDriver
from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR
from gpuswap.simcuda import SimDevice

GiB = 2**30

# A CUDA program stand-in: registers (busy: with a kernel that does not finish), says so, and once
# FINISH exists registers again without the kernel; then idles until killed.
PROC = """import os, sys, time
from gpuswap import simcuda
ready, finish = sys.argv[1], sys.argv[2]
simcuda.allocate(1 << 30, busy=os.environ.get("BUSY") == "1")
open(ready, "w").close()
while not os.path.exists(finish):
    time.sleep(0.02)
simcuda.allocate(1 << 30)
while True:
    time.sleep(1)
"""


class World:
    def __init__(self, root: Path, count: int):
        self.root = root
        self.device = SimDevice(root / "sim")
        self.gpus = SimulatedGpus(count, 80 * GiB, self.device)
        self.driver = SimulatedCheckpointDriver(self.gpus, self.device)
        self.procs: list[subprocess.Popen] = []

    def cuda_process(self, visible: Optional[str], busy: bool = False) -> tuple[int, Path]:
        """(pid, the file that lets its kernel finish) of a simulated CUDA process started with
        CUDA_VISIBLE_DEVICES=`visible` (None: unset, every GPU visible)."""
        n = len(self.procs)
        ready, finish = self.root / f"ready{n}", self.root / f"finish{n}"
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update({SIM_CUDA_DIR: str(self.device.root), "BUSY": "1" if busy else "0"})
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        p = subprocess.Popen([sys.executable, "-c", PROC, str(ready), str(finish)], env=env)
        self.procs.append(p)
        deadline = time.monotonic() + 120          # catches a process that never registers
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the CUDA process did not register"
            time.sleep(0.02)
        return p.pid, finish

    def freeze(self, pid: int) -> None:
        self.driver.lock(pid, 10_000)
        self.driver.checkpoint(pid)

    def gpu_of(self, pid: int) -> int:
        reg = self.device.registration(pid)
        assert reg is not None
        return self.device.driver_record(reg).where(reg.gpu)


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    w = World(tmp_path, 2)
    yield w
    for p in w.procs:
        p.kill()
        p.wait()


def test_a_gpu_map_for_a_process_that_sees_only_its_own_gpu_is_refused(world):
    """The daemon starts every job with CUDA_VISIBLE_DEVICES naming its own GPUs. The real driver
    refuses a GPU map for such a process with CUDA_ERROR_INVALID_VALUE, even an identity map
    (NVIDIA/cuda-python#1983, NVBug 5437334), and the process can still be restored where it was.
    A process that sees every GPU is moved as mapped."""
    masked, _ = world.cuda_process("1")
    world.freeze(masked)
    swap = {world.gpus.uuid(0): world.gpus.uuid(1), world.gpus.uuid(1): world.gpus.uuid(0)}
    identity = {world.gpus.uuid(i): world.gpus.uuid(i) for i in range(2)}
    for gpu_map in (swap, identity):
        with pytest.raises(CheckpointError) as e:
            world.driver.restore(masked, gpu_map)
        assert e.value.code == "CUDA_ERROR_INVALID_VALUE"
        assert world.driver.state(masked) == CHECKPOINTED
    world.driver.restore(masked)
    assert world.driver.state(masked) == LOCKED and world.gpu_of(masked) == 1
    world.driver.unlock(masked)

    for visible in (None, "1,0"):           # every GPU visible, in whatever order
        whole, _ = world.cuda_process(visible)
        home = world.gpu_of(whole)
        world.freeze(whole)
        world.driver.restore(whole, swap)
        assert world.driver.state(whole) == LOCKED and world.gpu_of(whole) == 1 - home
        world.driver.unlock(whole)


def test_the_simulated_driver_offers_no_migration(world):
    """What a real node's capability says (cuda_ckpt.NO_MIGRATION): the daemon never asks for a map."""
    cap = world.driver.capability
    assert cap.available and cap.simulated and not cap.migration
    assert "own GPUs" in cap.reason


def test_a_gpu_map_that_sends_two_gpus_to_one_is_refused(tmp_path):
    """Every GPU is in the map, but two of them go to one: refused, the process left CHECKPOINTED."""
    w = World(tmp_path, 3)
    try:
        pid, _ = w.cuda_process(None)
        w.freeze(pid)
        u = w.gpus.uuid
        with pytest.raises(CheckpointError) as e:
            w.driver.restore(pid, {u(0): u(1), u(1): u(1), u(2): u(2)})
        assert e.value.code == "CUDA_ERROR_INVALID_VALUE" and w.driver.state(pid) == CHECKPOINTED
        w.driver.restore(pid, {u(0): u(2), u(1): u(0), u(2): u(1)})
        assert w.driver.state(pid) == LOCKED and w.gpu_of(pid) == 2
    finally:
        for p in w.procs:
            p.kill()
            p.wait()


class SleepSignal:
    """A module's `time` whose sleep says, once, that the caller is waiting (then sleeps)."""

    def __init__(self) -> None:
        self.waiting = threading.Event()

    def sleep(self, s: float) -> None:
        self.waiting.set()
        time.sleep(s)

    monotonic = staticmethod(time.monotonic)


def test_a_lock_without_timeout_waits_until_the_work_finishes(world, monkeypatch):
    """timeoutMs 0 "indicates no timeout" (CUcheckpointLockArgs): the lock waits for the kernel
    however long it runs, and locks once it has finished; it is no NOT_READY at once."""
    pid, finish = world.cuda_process("0", busy=True)
    clock = SleepSignal()
    monkeypatch.setattr(simdriver, "time", clock)
    outcome: list[object] = []

    def lock() -> None:
        try:
            world.driver.lock(pid, 0)
            outcome.append("locked")
        except CheckpointError as e:
            outcome.append(e.code)
    t = threading.Thread(target=lock)
    t.start()
    assert clock.waiting.wait(60), "the lock never waited"
    finish.touch()                            # the kernel finishes: the process registers again
    t.join(120)
    assert outcome == ["locked"] and world.driver.state(pid) == LOCKED


def test_a_lock_with_a_timeout_gives_up_and_leaves_the_process_running(world):
    pid, _ = world.cuda_process("0", busy=True)
    with pytest.raises(CheckpointError) as e:
        world.driver.lock(pid, 50)
    assert e.value.timed_out and world.driver.state(pid) == RUNNING


def test_an_allocation_of_a_locked_process_blocks_until_it_is_unlocked(world, monkeypatch):
    """A CUDA call of a process the driver holds blocks ("block further CUDA API calls",
    cuCheckpointProcessLock): a frozen job registers no new memory until it is thawed."""
    monkeypatch.setenv(SIM_CUDA_DIR, str(world.device.root))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    simcuda.allocate(GiB)
    me = os.getpid()
    world.driver.lock(me, 1000)
    clock = SleepSignal()
    monkeypatch.setattr(simcuda, "time", SimpleNamespace(sleep=clock.sleep))
    t = threading.Thread(target=simcuda.allocate, args=(2 * GiB,))
    t.start()
    assert clock.waiting.wait(60), "the allocation did not block"
    assert world.device.registration(me).nbytes == GiB          # nothing registered while locked
    world.driver.unlock(me)
    t.join(120)
    assert not t.is_alive() and world.device.registration(me).nbytes == 2 * GiB


# A process that creates a CUDA context and allocates `sys.argv[1]` bytes (0: nothing), then idles;
# with a third argument NVML does not report its usage.
CONTEXT_ONLY = """import sys, time
from gpuswap import simcuda
simcuda.allocate(int(sys.argv[1]), usage_reported=len(sys.argv) < 4)
open(sys.argv[2], "w").close()
while True:
    time.sleep(1)
"""


def _context_process(world: World, nbytes: int, context: Optional[str] = None,
                     usage_reported: bool = True) -> subprocess.Popen:
    ready = world.root / f"ctx-ready{len(world.procs)}"
    env = dict(os.environ, **{SIM_CUDA_DIR: str(world.device.root), "CUDA_VISIBLE_DEVICES": "0"})
    env.pop(SIM_CONTEXT_BYTES, None)
    if context is not None:
        env[SIM_CONTEXT_BYTES] = context
    p = subprocess.Popen([sys.executable, "-c", CONTEXT_ONLY, str(nbytes), str(ready)]
                         + ([] if usage_reported else ["unreported"]), env=env)
    world.procs.append(p)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the CUDA process did not register"
        time.sleep(0.02)
    return p


def _listed(world: World) -> dict[int, Optional[int]]:
    return {p.pid: p.used_bytes for p in world.gpus.list()[0].processes}


def test_nvml_may_list_a_process_without_its_usage_and_the_gpu_still_counts_its_memory(world):
    """usedGpuMemory may be NVML_VALUE_NOT_AVAILABLE (NVML API reference, nvmlProcessInfo_t; pynvml
    gives None): the process is listed with no figure, and the device's memory used still counts it
    (its context too)."""
    p = _context_process(world, GiB, usage_reported=False)
    assert _listed(world) == {p.pid: None}
    assert world.gpus.list()[0].mem_used == GiB + simcuda.DEFAULT_CONTEXT_BYTES


def test_a_cuda_context_holds_device_memory_until_checkpoint_or_exit(world):
    """NVML lists "processes with a compute context", their usedGpuMemory "all of the memory used
    by the application" (NVML API reference): a process that created a context holds it, listed,
    even if it allocated nothing (pytorch/pytorch#28113, #20532). A lock keeps it; a checkpoint
    releases it with the rest ("all underlying references will be released"; the process vanishes,
    cuda-checkpoint README, NVIDIA/cuda-checkpoint#31); a restore brings it back; an exit frees it."""
    ctx = simcuda.DEFAULT_CONTEXT_BYTES
    idle = _context_process(world, 0)
    busy = _context_process(world, GiB)
    assert _listed(world) == {idle.pid: ctx, busy.pid: ctx + GiB}
    assert world.gpus.list()[0].mem_used == 2 * ctx + GiB
    world.driver.lock(idle.pid, 10_000)
    assert _listed(world)[idle.pid] == ctx                       # locked: still there, context and all
    world.driver.checkpoint(idle.pid)
    assert _listed(world) == {busy.pid: ctx + GiB}               # checkpointed: gone, its context too
    assert world.gpus.list()[0].mem_used == ctx + GiB
    world.driver.restore(idle.pid)
    world.driver.unlock(idle.pid)
    assert _listed(world) == {idle.pid: ctx, busy.pid: ctx + GiB}
    busy.kill()
    busy.wait()
    assert _listed(world) == {idle.pid: ctx} and world.gpus.list()[0].mem_used == ctx


def test_a_checkpoint_and_a_restore_take_the_time_an_h100_took_for_the_bytes(world, monkeypatch):
    """On an H100 a freeze of 4.6 GiB took 1.98 s and a thaw 0.82 s (docs/selftest.md): the calls
    here take as long for the bytes the process holds, its context included. While a checkpoint
    copies, the process is LOCKED and still listed with all of it; while a restore copies, its
    memory is back already (the room is taken first)."""
    ctx = simcuda.DEFAULT_CONTEXT_BYTES
    pid, _ = world.cuda_process(None)
    held = GiB + ctx
    during: list[tuple[float, str, Optional[int]]] = []

    def copy(seconds: float) -> None:
        during.append((seconds, world.driver.state(pid), _listed(world).get(pid)))
        time.sleep(seconds)

    monkeypatch.setattr(simdriver, "_copy", copy)
    world.driver.lock(pid, 10_000)
    t0 = time.monotonic()
    world.driver.checkpoint(pid)
    took = time.monotonic() - t0
    assert during == [(held / simdriver.CHECKPOINT_BYTES_PER_S, LOCKED, held)]
    assert took >= held / simdriver.CHECKPOINT_BYTES_PER_S and pid not in _listed(world)
    t0 = time.monotonic()
    world.driver.restore(pid)
    took = time.monotonic() - t0
    assert during[1:] == [(held / simdriver.RESTORE_BYTES_PER_S, LOCKED, held)]
    assert took >= held / simdriver.RESTORE_BYTES_PER_S
    world.driver.unlock(pid)
    assert world.driver.state(pid) == RUNNING and _listed(world)[pid] == held


def test_the_context_is_sized_when_it_is_created_and_a_restore_needs_room_for_it(tmp_path):
    """The context's size comes from GPUSWAP_SIM_CONTEXT_BYTES as the process creates it. A GPU
    with room for a frozen process's allocations but not its context cannot take it back: the
    restore fails with CUDA_ERROR_OUT_OF_MEMORY and leaves it stuck (cuda-checkpoint#44)."""
    MiB = 2**20
    w = World(tmp_path, 1)
    w.gpus.mem_total = 4 * GiB
    try:
        frozen = _context_process(w, 2 * GiB, context="256MiB")
        assert _listed(w) == {frozen.pid: 2 * GiB + 256 * MiB}
        w.freeze(frozen.pid)
        _context_process(w, 2 * GiB - 512 * MiB, context="384MiB")   # leaves 2 GiB + 128 MiB free
        with pytest.raises(CheckpointError) as e:
            w.driver.restore(frozen.pid)
        assert e.value.code == "CUDA_ERROR_OUT_OF_MEMORY" and w.driver.state(frozen.pid) == CHECKPOINTED
    finally:
        for p in w.procs:
            p.kill()
            p.wait()
