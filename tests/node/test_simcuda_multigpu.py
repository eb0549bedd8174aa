"""A simulated CUDA process holds memory per GPU, as a real one does: a context on every GPU it
touched, and NVML lists it on each with what it holds there (also with its context alone where it
only maps a peer's memory: pytorch/pytorch#54564, tensorflow/tensorflow#52285,
NVIDIA/DeepLearningExamples#776). The simulated driver checkpoints all of it, needs room on every
GPU to restore it, and moves each GPU as a GPU map says (gpuswap/simrecords.py, node/simdriver.py).
The old simulation moved a process to the last GPU it allocated on; each test here fails on it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

from gpuswap.node.cuda_ckpt import CHECKPOINTED, CheckpointError
from gpuswap.node.gpus import SimulatedGpus
from gpuswap.node.simdriver import SimulatedCheckpointDriver
from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR
from gpuswap.simcuda import DEFAULT_CONTEXT_BYTES as CTX, SimDevice

GiB = 2**30

# A CUDA program stand-in: for each "DEVICE:BYTES" argument, in order, allocates BYTES on that
# device ordinal; says so; then, once MORE exists, allocates 3 GiB on device 0 and says so again.
PROC = """import sys, os, time
from gpuswap import simcuda
ready, more = sys.argv[1], sys.argv[2]
for spec in sys.argv[3:]:
    device, nbytes = spec.split(":")
    simcuda.allocate(int(nbytes), device=int(device))
open(ready, "w").close()
while not os.path.exists(more):
    time.sleep(0.02)
simcuda.allocate(3 << 30, device=0)
open(ready + ".more", "w").close()
while True:
    time.sleep(1)
"""


class World:
    def __init__(self, root: Path, count: int, size: int):
        self.root = root
        self.device = SimDevice(root / "sim")
        self.gpus = SimulatedGpus(count, size, self.device)
        self.driver = SimulatedCheckpointDriver(self.gpus, self.device)
        self.procs: list[subprocess.Popen] = []

    def cuda_process(self, visible: Optional[str], *allocs: tuple[int, int]) -> tuple[int, Path]:
        """(pid, the file that makes it allocate 3 GiB more on device 0) of a simulated CUDA
        process with CUDA_VISIBLE_DEVICES=`visible` (None: unset), after its (device, bytes) calls."""
        n = len(self.procs)
        ready, more = self.root / f"ready{n}", self.root / f"more{n}"
        env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", SIM_CONTEXT_BYTES)}
        env[SIM_CUDA_DIR] = str(self.device.root)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        p = subprocess.Popen([sys.executable, "-c", PROC, str(ready), str(more)]
                             + [f"{d}:{b}" for d, b in allocs], env=env)
        self.procs.append(p)
        wait_for(ready, p)
        return p.pid, more

    def listed(self) -> list[dict[int, Optional[int]]]:
        """Per GPU: pid -> NVML's usedGpuMemory."""
        return [{p.pid: p.used_bytes for p in g.processes} for g in self.gpus.list()]

    def used(self) -> list[Optional[int]]:
        return [g.mem_used for g in self.gpus.list()]

    def freeze(self, pid: int) -> None:
        self.driver.lock(pid, 10_000)
        self.driver.checkpoint(pid)

    def thaw(self, pid: int, gpu_map: Optional[dict[str, str]] = None) -> None:
        self.driver.restore(pid, gpu_map)
        self.driver.unlock(pid)


def wait_for(path: Path, p: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120          # catches a process that never gets there
    while not path.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the CUDA process did not get there"
        time.sleep(0.02)


@pytest.fixture
def world(tmp_path) -> Iterator[World]:
    w = World(tmp_path, 2, 8 * GiB)
    yield w
    for p in w.procs:
        p.kill()
        p.wait()


def test_a_process_that_touched_two_gpus_is_listed_on_both_with_a_context_on_each(world):
    """A call on a second device leaves the first as it was: both GPUs list the process, each with
    its context there; one that only touched the second device (allocate 0: a peer mapping) holds
    its context alone there."""
    both, _ = world.cuda_process("0,1", (0, GiB), (1, 2 * GiB))
    peer, _ = world.cuda_process("0,1", (0, GiB), (1, 0))
    assert world.listed() == [{both: CTX + GiB, peer: CTX + GiB}, {both: CTX + 2 * GiB, peer: CTX}]
    assert world.used() == [2 * (CTX + GiB), 2 * CTX + 2 * GiB]


def test_a_checkpoint_frees_every_gpu_and_a_restore_needs_room_on_each(world):
    """Locked, the process keeps all it holds on both GPUs; checkpointed, it holds nothing on
    either. Another process then takes the first GPU: a restore, which brings back what the process
    held on each GPU, finds too little there and fails with CUDA_ERROR_OUT_OF_MEMORY, leaving the
    process stuck (cuda-checkpoint#44: every later restore fails), though the second GPU had room."""
    pid, _ = world.cuda_process("0,1", (0, 2 * GiB), (1, GiB))
    world.driver.lock(pid, 10_000)
    assert world.listed() == [{pid: CTX + 2 * GiB}, {pid: CTX + GiB}]
    world.driver.checkpoint(pid)
    assert world.listed() == [{}, {}] and world.used() == [0, 0]
    filler, _ = world.cuda_process("0", (0, 6 * GiB - CTX))     # GPU 0: 2 GiB free, 2.5 GiB needed
    with pytest.raises(CheckpointError) as e:
        world.driver.restore(pid)
    assert e.value.code == "CUDA_ERROR_OUT_OF_MEMORY" and world.driver.state(pid) == CHECKPOINTED
    assert world.listed() == [{filler: 6 * GiB}, {}]
    with pytest.raises(CheckpointError) as e:
        world.driver.restore(pid)
    assert e.value.code == "CUDA_ERROR_OPERATING_SYSTEM"


def test_a_restore_with_room_on_every_gpu_brings_all_of_it_back(world):
    pid, _ = world.cuda_process("0,1", (0, 2 * GiB), (1, GiB))
    world.freeze(pid)
    world.thaw(pid)
    assert world.listed() == [{pid: CTX + 2 * GiB}, {pid: CTX + GiB}]


def test_a_gpu_map_moves_each_gpu_of_the_process_and_later_calls_land_where_it_is(world):
    """A process that sees every GPU, restored with the two GPUs swapped: what it held on each is
    now on the other, and its next allocation on device 0 is counted on the GPU device 0 went to."""
    pid, more = world.cuda_process(None, (0, 2 * GiB), (1, GiB))
    world.freeze(pid)
    u = world.gpus.uuid
    world.thaw(pid, {u(0): u(1), u(1): u(0)})
    assert world.listed() == [{pid: CTX + GiB}, {pid: CTX + 2 * GiB}]
    more.touch()
    wait_for(world.root / "ready0.more", world.procs[0])
    assert world.listed() == [{pid: CTX + GiB}, {pid: CTX + 3 * GiB}]
