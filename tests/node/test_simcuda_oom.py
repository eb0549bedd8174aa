"""A full simulated GPU refuses memory as a real one does (gpuswap.simcuda gives the sources):
cudaMalloc's cudaErrorMemoryAllocation, torch's "CUDA out of memory. Tried to allocate ...", and a
context creation on a GPU others filled ("CUDA error: out of memory"). Room is what the simulated
NVML counts as resident: a checkpointed process holds nothing, and the driver's restore counts
the same way. Two processes racing for the last bytes cannot both get them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from gpuswap import simcuda
from gpuswap.node.cuda_ckpt import CHECKPOINTED, CheckpointError
from gpuswap.node.gpus import SimulatedGpus
from gpuswap.node.simdriver import SimulatedCheckpointDriver
from gpuswap.protocol.env import SIM_CONTEXT_BYTES, SIM_CUDA_DIR
from gpuswap.simcuda import OutOfMemoryError, SimDevice

GiB = 2**30
CONTEXT = GiB // 2
TOTAL = 4 * GiB

# A CUDA program stand-in: waits for GATE (if given), allocates NBYTES, writes the outcome to OUT,
# then idles until killed (its memory held, as a living process's is).
PROC = """import json, os, sys, time
from gpuswap import simcuda
nbytes, gate, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
while gate != "-" and not os.path.exists(gate):
    time.sleep(0.01)
try:
    simcuda.allocate(nbytes)
    result = {"ok": True}
except simcuda.OutOfMemoryError as e:
    result = {"ok": False, "error": str(e), "context_creation": e.context_creation}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(result, f)
os.replace(tmp, out)
while True:
    time.sleep(1)
"""


class Node:
    """One simulated GPU of TOTAL bytes, its driver, and simulated CUDA processes on it."""

    def __init__(self, root: Path):
        self.root = root
        self.device = SimDevice(root / "sim")
        self.gpus = SimulatedGpus(1, TOTAL, self.device)
        self.driver = SimulatedCheckpointDriver(self.gpus, self.device)   # writes gpus.json, as the daemon does
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", **{SIM_CUDA_DIR: str(self.device.root),
                                                                  SIM_CONTEXT_BYTES: str(CONTEXT)})

    def start(self, nbytes: int, gate: str = "-") -> tuple[subprocess.Popen, Path]:
        out = self.root / f"out{len(self.procs)}.json"
        p = subprocess.Popen([sys.executable, "-c", PROC, str(nbytes), gate, str(out)], env=self.env)
        self.procs.append(p)
        return p, out

    def outcome(self, p: subprocess.Popen, out: Path) -> dict:
        deadline = time.monotonic() + 120          # catches a process that never gets an answer
        while not out.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the CUDA process gave no outcome"
            time.sleep(0.02)
        return json.loads(out.read_text())

    def run(self, nbytes: int) -> tuple[int, dict]:
        p, out = self.start(nbytes)
        return p.pid, self.outcome(p, out)


@pytest.fixture
def node(tmp_path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    for p in n.procs:
        p.kill()
        p.wait()


@pytest.fixture
def me(node, monkeypatch) -> SimDevice:
    """This test process as a simulated CUDA process on the node's GPU."""
    monkeypatch.setenv(SIM_CUDA_DIR, str(node.device.root))
    monkeypatch.setenv(SIM_CONTEXT_BYTES, str(CONTEXT))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return node.device


def test_an_allocation_past_the_gpu_fails_with_torchs_message_and_takes_nothing(node, me):
    other, seen = node.run(GiB)                                   # 1.5 GiB resident, its context included
    assert seen == {"ok": True}
    with pytest.raises(OutOfMemoryError) as e:
        simcuda.allocate(5 * GiB // 2)                            # context fits; 2.5 GiB more do not
    assert isinstance(e.value, RuntimeError) and not e.value.context_creation
    assert str(e.value).startswith("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity "
                                   "of 4.00 GiB of which 2.00 GiB is free.")
    # the context was created before the allocation failed, and stays, as a real one does
    assert me.registration(os.getpid()).used == CONTEXT
    assert sorted(me.resident()) == sorted([(other, 0, CONTEXT + GiB), (os.getpid(), 0, CONTEXT)])
    assert simcuda.allocate(2 * GiB).used == CONTEXT + 2 * GiB     # exactly full: fits
    with pytest.raises(OutOfMemoryError) as e:
        simcuda.allocate(2 * GiB + 1)
    assert "Tried to allocate 1 bytes" in str(e.value) and "of which 0 bytes is free" in str(e.value)
    assert me.registration(os.getpid()).nbytes == 2 * GiB          # the failed call registered nothing
    assert sum(b for _, _, b in me.resident()) == TOTAL
    assert simcuda.allocate(GiB).nbytes == GiB                    # a free never fails


def test_a_context_cannot_be_created_on_a_full_gpu_and_nothing_is_registered(node, me, monkeypatch):
    node.run(3 * GiB)                                             # 3.5 GiB resident: 0.5 GiB free
    monkeypatch.setenv(SIM_CONTEXT_BYTES, str(CONTEXT + 1))       # a context one byte too big
    with pytest.raises(OutOfMemoryError) as e:
        simcuda.allocate(0)
    assert e.value.context_creation and str(e.value).startswith("CUDA error: out of memory")
    assert me.registration(os.getpid()) is None
    pid, seen = node.run(0)                                       # a context that fits exactly
    assert seen == {"ok": True} and me.registration(pid).used == CONTEXT


def test_a_checkpointed_process_leaves_its_memory_to_others_and_a_restore_counts_the_same(node):
    a, seen = node.run(3 * GiB)                                   # 3.5 GiB
    assert seen == {"ok": True}
    b, seen = node.run(GiB)                                       # its context fits, its 1 GiB does not
    assert seen["ok"] is False and "Tried to allocate 1024.00 MiB" in seen["error"]   # torch writes 1 GiB so
    assert node.device.registration(b).used == CONTEXT            # the GPU is full now
    node.driver.lock(a, 10_000)
    _, seen = node.run(GiB)                                       # locked: `a` still holds all of it
    assert seen["ok"] is False and seen["context_creation"] is True
    node.driver.checkpoint(a)                                     # checkpointed: `a` holds nothing
    _, seen = node.run(GiB)
    assert seen == {"ok": True}
    assert node.gpus.list()[0].mem_used == CONTEXT + CONTEXT + GiB
    with pytest.raises(CheckpointError) as e:                     # 3.5 GiB cannot come back into 2
        node.driver.restore(a)
    assert e.value.code == "CUDA_ERROR_OUT_OF_MEMORY" and node.driver.state(a) == CHECKPOINTED


def test_two_processes_racing_for_the_last_bytes_one_wins(node):
    """Both find 3 GiB free if they look before either takes it; the device's lock makes the look
    and the take one step. The test holds the lock until both are waiting on it (/proc/locks
    lists a blocked flock with "->"), so they do race for it."""
    gate = node.root / "gate"
    racers = [node.start(GiB + GiB // 2, str(gate)) for _ in range(2)]   # 2 GiB each, 4 GiB in all: ...
    node.run(0)                                                   # ... with a 0.5 GiB context beside: one fits
    with node.device.exclusive():
        gate.touch()
        deadline = time.monotonic() + 120
        while _waiters(node.device.root / simcuda.LOCK_FILE) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p, _ in racers), "racers not waiting"
            time.sleep(0.02)
    outcomes = [node.outcome(p, out) for p, out in racers]
    assert sorted(o["ok"] for o in outcomes) == [False, True], outcomes
    assert node.gpus.list()[0].mem_used <= TOTAL


def _waiters(path: Path) -> int:
    """Processes blocked on an flock of `path` (/proc/locks: "N: -> FLOCK ... PID MAJ:MIN:INODE ...")."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line.split() and "FLOCK" in line.split()
                   and line.split()[-3].rsplit(":", 1)[-1] == str(inode))


def test_without_a_description_of_the_gpus_a_process_finds_no_device(tmp_path, monkeypatch):
    dev = SimDevice(tmp_path / "sim")
    dev.prepare()
    monkeypatch.setenv(SIM_CUDA_DIR, str(dev.root))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(RuntimeError, match="no CUDA-capable device"):
        simcuda.allocate(0)
    (dev.root / simcuda.GPUS_FILE).write_text('{"totals": [-1]}')
    with pytest.raises(RuntimeError, match="no CUDA-capable device"):
        simcuda.allocate(0)
    dev.describe([GiB])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        simcuda.allocate(0)
    assert dev.registrations() == []
