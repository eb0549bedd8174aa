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
    the attached memory was really released while parked, then resumes the job. A restored run
    asks for nothing."""

    def __init__(self) -> None:
        self.plan = {int(at): tier for tier, _, at in
                     (w.partition(":") for w in os.environ.get("FW_PAUSES", "").split(",") if w)}
        self.parked_bytes: list[int] = []

    def maybe(self, job: Any, step: int) -> None:
        tier = self.plan.get(step)
        if tier is None or not getattr(job, "inside", False) or job.restored_step is not None:
            return
        before = job.device_bytes()
        t = threading.Thread(target=job.request_pause, args=(tier,))
        t.start()
        t.join()
        if tier == "ram":
            threading.Thread(target=self._resume_when_parked, args=(job, before), daemon=True).start()

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
