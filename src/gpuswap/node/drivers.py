"""Which checkpoint driver a node parks through: the daemon and a pool node's agent both choose here."""
from __future__ import annotations

from pathlib import Path

from gpuswap.node import cuda_ckpt
from gpuswap.node.cuda_ckpt import CheckpointDriver
from gpuswap.node.gpus import GpuInventory, NvmlGpus, SimulatedGpus


def checkpoint_driver(home: Path, gpus: GpuInventory) -> CheckpointDriver:
    """The driver checkpoint API for transparent parking: simulated with simulated GPUs, else the
    real one if this node's driver and cuda-bindings support it (else one that says why not)."""
    if isinstance(gpus, NvmlGpus):
        cap = cuda_ckpt.detect(gpus.persistence(), gpus.driver)
        if cap.available:
            try:
                return cuda_ckpt.CudaCheckpointDriver(cap)
            except Exception as e:   # cuInit failing: report it, run without transparent parking
                cap = cuda_ckpt.Capability(False, f"cuInit failed: {e}", driver=gpus.driver)
        return cuda_ckpt.UnavailableDriver(cap)
    from gpuswap.node.simdriver import SimulatedCheckpointDriver
    from gpuswap.simcuda import SimDevice

    assert isinstance(gpus, SimulatedGpus)
    gpus.device = SimDevice(sim_device_dir(home))      # its NVML process list shows what the driver did
    return SimulatedCheckpointDriver(gpus, gpus.device)


def sim_device_dir(home: Path) -> Path:
    """Where simulated CUDA processes register and the simulated driver keeps its record."""
    return home / "simulated-driver"
