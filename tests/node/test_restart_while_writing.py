"""A daemon restart converges at any instant, also while supervisors rewrite their status files.

At every start the daemon sets the modes of every job's files (`homedir.tighten_jobs`). A live
supervisor's atomic write (`fsutil`: a temporary file, then a rename) can make a file it listed
vanish before its chmod: that was fatal at start ("cannot make the job files ... private").
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuswap.node.homedir import tighten_jobs

WRITER = r"""
import sys
from pathlib import Path
from gpuswap.fsutil import atomic_write_json
runs = [Path(p) for p in sys.argv[1:]]
n = 0
while True:
    for run in runs:
        atomic_write_json(run / "status.json", {"n": n})
    n += 1
"""


def test_setting_job_file_modes_skips_files_renamed_away_meanwhile(tmp_path: Path):
    runs = []
    for job in range(1, 9):
        run = tmp_path / "jobs" / str(job) / "run-1"
        run.mkdir(parents=True)
        runs.append(str(run))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, *runs])      # a supervisor's writes, as they come
    try:
        for _ in range(3000):       # ~1% of these passes met a vanished temporary file before
            assert tighten_jobs(tmp_path, lambda job_id: None) == 8
        assert writer.poll() is None, "the writer died: nothing was racing"
    finally:
        writer.kill()
        writer.wait()
