"""Shared by the framework job scripts: pause triggers driven from inside the job, and the
parameter digest the tests compare."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import Any

import torch


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class PauseAt:
    """Pauses asked for from inside the job, as a supervisor message would (from another
    thread): `$FW_PAUSES` is e.g. "ram:10,disk:16" (tier:step). For ram, a second thread checks
    the attached memory was really released while parked, then resumes the job; "spill" parks in
    RAM, then asks for disk while parked (exit 75). A restored run asks for nothing."""

    def __init__(self) -> None:
        self.plan = {int(at): tier for tier, _, at in
                     (w.partition(":") for w in os.environ.get("FW_PAUSES", "").split(",") if w)}
        self.parked_bytes: list[int] = []

    def maybe(self, job: Any, step: int) -> None:
        tier = self.plan.get(step)
        if tier is None or not getattr(job, "inside", False) or job.restored_step is not None:
            return
        before = job.device_bytes()
        t = threading.Thread(target=job.request_pause, args=("ram" if tier == "spill" else tier,))
        t.start()
        t.join()
        if tier == "ram":
            threading.Thread(target=self._resume_when_parked, args=(job, before), daemon=True).start()
        elif tier == "spill":   # parked in RAM, then moved to disk from the host copies (exit 75)
            threading.Thread(target=self._spill_when_parked, args=(job, before), daemon=True).start()

    def _spill_when_parked(self, job: Any, before: int) -> None:
        """What a daemon short of host RAM does to a RAM-parked job: a disk pause while parked."""
        while not job.parked:
            time.sleep(0.005)
        job.state.setdefault("fw_parked_bytes", []).append(before - job.device_bytes())
        job.request_pause("disk")

    def _resume_when_parked(self, job: Any, before: int) -> None:
        while not job.parked:
            time.sleep(0.005)
        released = before - job.device_bytes()
        self.parked_bytes.append(released)
        job.state.setdefault("fw_parked_bytes", []).append(released)  # survives a later disk park
        job.request_resume()


def write_result(path: str, **fields: Any) -> None:
    with open(path, "w") as f:
        json.dump(fields, f)


def digest(value: Any) -> str:
    """sha256 of nested dicts/lists of tensors and plain values (optimizer state, RNG states):
    equal digests mean bitwise equal state."""
    h = hashlib.sha256()

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
            h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(f"K{k!r}".encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for x in v:
                walk(x)
        else:
            h.update(f"V{v!r}".encode())

    walk(value)
    return h.hexdigest()


def hold_until_pause_asked(job: Any, step: int) -> None:
    """Multi-rank jobs under a real daemon: at a step named in `$FW_HOLD_AT` (e.g. "2,7"), wait,
    before the framework's safepoint, until the supervisor's `pause` has reached this rank, so the
    test's `gpuswap pause` cannot miss the job (it would otherwise run to its end first). The
    park itself then happens at the callback's own safepoint. Outside gpuswap: nothing."""
    if step not in {int(s) for s in os.environ.get("FW_HOLD_AT", "").split(",") if s}:
        return
    cursor = getattr(job, "_cursor", None)     # a rank's view of the agreement (runtime/rankcursor.py)
    deadline = time.monotonic() + 600
    while cursor is not None and cursor.phase != "asked" and time.monotonic() < deadline:
        time.sleep(0.01)
