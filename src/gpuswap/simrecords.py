"""The simulated CUDA device's records (gpuswap.simcuda): what a process holds on each GPU, and where
the simulated driver has put it. Both are files any process may have written, so every byte is
read as untrusted: a record that is not exactly one of these shapes is no record (`parse`, None).

Per GPU, as a real process: a CUDA context exists on every GPU the process has touched, created by
its first call there, and NVML lists the process on each such GPU with what it holds there (the
context alone where it only maps a peer's memory: pytorch/pytorch#54564, tensorflow/tensorflow#52285,
NVIDIA/DeepLearningExamples#776). So a registration holds one `Held` per GPU, in the order the
process first touched them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_BYTES = 2**53
MAX_GPUS = 1024
STATES = ("running", "locked", "checkpointed")   # cuda_ckpt's driver states


def _int(v: Any, lo: int, hi: int) -> int:
    """`v` if it is an int (not a bool, not a float or string) within [lo, hi]; else ValueError."""
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"not an integer in [{lo}, {hi}]: {v!r}"[:80])
    return v


def _bool(v: Any, default: bool) -> bool:
    if v is None:
        return default
    if type(v) is not bool:
        raise ValueError(f"not a boolean: {v!r}"[:80])
    return v


@dataclass(frozen=True)
class Held:
    """What a process holds on one GPU: the context its first call there created, and allocations.
    `gpu`: the node's GPU its device ordinal named when it allocated (CUDA_VISIBLE_DEVICES); where
    that is now, after a restore with a GPU map, is the driver's record's to say (`DriverRecord.where`)."""
    gpu: int
    context: int
    nbytes: int

    @property
    def used(self) -> int:
        """NVML's usedGpuMemory for the process on this GPU while resident: context and allocations."""
        return self.context + self.nbytes


@dataclass(frozen=True)
class Registration:
    pid: int
    start: int                 # start_ticks when it registered
    held: tuple[Held, ...]     # one per GPU it touched, first touched first; never empty
    busy: bool = False         # a kernel that never finishes: a lock waits for it and times out
    usage_reported: bool = True   # False: NVML lists it with usedGpuMemory not available (simcuda.allocate)

    @property
    def gpu(self) -> int:
        """The first GPU it touched (where a one-GPU process lives)."""
        return self.held[0].gpu

    @property
    def gpus(self) -> list[int]:
        return [h.gpu for h in self.held]

    @property
    def nbytes(self) -> int:
        """Its allocations, on every GPU."""
        return sum(h.nbytes for h in self.held)

    @property
    def used(self) -> int:
        """All it holds while resident, contexts included, on every GPU."""
        return sum(h.used for h in self.held)

    def on(self, gpu: int) -> Optional[Held]:
        return next((h for h in self.held if h.gpu == gpu), None)

    def with_held(self, held: Held, **flags: bool) -> "Registration":
        """This registration with `held` replacing what it held on that GPU (or a new GPU, last)."""
        rest = tuple(held if h.gpu == held.gpu else h for h in self.held)
        if self.on(held.gpu) is None:
            rest += (held,)
        return Registration(self.pid, self.start, rest, flags.get("busy", self.busy),
                            flags.get("usage_reported", self.usage_reported))

    def to_json(self) -> dict:
        return {"pid": self.pid, "start": self.start, "busy": self.busy, "usage_reported": self.usage_reported,
                "held": [{"gpu": h.gpu, "context": h.context, "nbytes": h.nbytes} for h in self.held]}

    @classmethod
    def parse(cls, raw: bytes) -> Optional["Registration"]:
        """The registration in `raw` (untrusted), or None: not JSON, a field missing or of another
        type, a size past MAX_BYTES, a GPU past MAX_GPUS, no GPU or one GPU twice."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or not isinstance(d.get("held"), list):
                return None
            if not 1 <= len(d["held"]) <= MAX_GPUS or not all(isinstance(h, dict) for h in d["held"]):
                return None
            held = tuple(Held(_int(h["gpu"], 0, MAX_GPUS - 1), _int(h["context"], 0, MAX_BYTES),
                              _int(h["nbytes"], 0, MAX_BYTES)) for h in d["held"])
            reg = cls(_int(d["pid"], 1, 2**31), _int(d["start"], 0, 2**63), held,
                      _bool(d.get("busy"), False), _bool(d.get("usage_reported"), True))
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        return reg if len(set(reg.gpus)) == len(held) else None


@dataclass(frozen=True)
class DriverRecord:
    """Where the simulated driver has a process: its state, whether a failed restore left it stuck
    (`poisoned`), and, after a restore with a GPU map, which node GPU each of its GPUs is on now
    (`moved`: (from, to) pairs, one-to-one; a GPU not named is where it was)."""
    state: str = "running"
    poisoned: bool = False
    moved: tuple[tuple[int, int], ...] = field(default=())

    def where(self, gpu: int) -> int:
        return dict(self.moved).get(gpu, gpu)

    def to_json(self, start: int) -> dict:
        return {"start": start, "state": self.state, "poisoned": self.poisoned, "moved": [list(p) for p in self.moved]}

    @classmethod
    def parse(cls, raw: bytes, start: int) -> Optional["DriverRecord"]:
        """The record in `raw` for the process started at `start`, or None (another process's with
        that pid, or not exactly this shape; the daemon writes these, but a reader must not crash)."""
        try:
            d = json.loads(raw)
            if not isinstance(d, dict) or d.get("start") != start or d.get("state") not in STATES:
                return None
            pairs = d.get("moved", [])
            if not isinstance(pairs, list) or len(pairs) > MAX_GPUS:
                return None
            moved = tuple((_int(p[0], 0, MAX_GPUS - 1), _int(p[1], 0, MAX_GPUS - 1))
                          for p in pairs if isinstance(p, list) and len(p) == 2)
            if len(moved) != len(pairs) or len({a for a, _ in moved}) != len(moved) \
                    or len({b for _, b in moved}) != len(moved):
                return None
            return cls(d["state"], _bool(d.get("poisoned"), False), moved)
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
