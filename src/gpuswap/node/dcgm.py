"""dcgm-exporter job-mapping files, so DCGM's own GPU metrics carry the gpuswap job id.

dcgm-exporter (`--hpc-job-mapping-dir DIR`, env DCGM_HPC_JOB_MAPPING_DIR) reads one file per GPU,
named by the GPU's index, listing the ids of the jobs on it one per line, and adds an `hpc_job`
label to that GPU's series. We rewrite the files from the jobs table every couple of seconds
(level-triggered: a missed change is fixed on the next pass), each atomically, and only when its
content changes.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Optional

from gpuswap.fsutil import atomic_write_bytes
from gpuswap.node.store import JobRecord

log = logging.getLogger("gpuswap.dcgm")


def mapping(live: list[JobRecord], gpu_indices: list[int]) -> dict[str, str]:
    """File name -> content: the ids of the jobs whose memory is on each GPU now."""
    on: dict[int, list[int]] = {g: [] for g in gpu_indices}
    for j in live:
        if j.holds_gpu:
            for g in j.assigned:
                on.setdefault(g, []).append(j.id)
    return {str(g): "".join(f"{i}\n" for i in sorted(ids)) for g, ids in on.items()}


def write_mapping(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = directory / name
        try:
            if path.read_text() == content:
                continue
        except FileNotFoundError:
            pass
        atomic_write_bytes(path, content.encode(), 0o644)    # DCGM's exporter reads it as its own user


class MappingWriter:
    """A thread that keeps `directory` in step with the jobs, every `period_s`."""

    def __init__(self, directory: Path, live_jobs: Callable[[], list[JobRecord]],
                 gpu_indices: Callable[[], list[int]], period_s: float = 2.0):
        self.directory, self.live_jobs, self.gpu_indices, self.period_s = directory, live_jobs, gpu_indices, period_s
        self._failure: Optional[tuple[str, Optional[int]]] = None   # the last pass's error: type, errno
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dcgm-mapping", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.write_once()
            self._stop.wait(self.period_s)

    def write_once(self) -> None:
        """One pass. A failure (a full disk, the directory replaced by a file) must not take the
        daemon down, and is retried every pass; it is logged when it starts or changes kind, and
        its end once, not on every pass: a failure that lasts would otherwise fill the log."""
        try:
            write_mapping(self.directory, mapping(self.live_jobs(), self.gpu_indices()))
        except Exception as e:
            kind = (type(e).__name__, getattr(e, "errno", None))   # not the text: it may name a temporary file
            if kind != self._failure:
                self._failure = kind
                log.error("cannot write the dcgm-exporter job mapping to %s: %s (retried every %g s; "
                          "logged again when it works or fails otherwise)", self.directory,
                          (e.strerror or e) if isinstance(e, OSError) else repr(e), self.period_s,
                          exc_info=not isinstance(e, OSError))    # not an OSError: a bug, its traceback once
        else:
            if self._failure is not None:
                self._failure = None
                log.warning("writing the dcgm-exporter job mapping to %s works again", self.directory)
