"""`import gpuswap` (and attach outside a job) never imports the optional frameworks."""
from __future__ import annotations

import os
import subprocess
import sys


def test_import_gpuswap_imports_no_framework() -> None:
    code = ("import sys, gpuswap, gpuswap.runtime.slurm; job = gpuswap.attach(); "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith(("GPUSWAP_", "SLURM_"))})
    assert res.returncode == 0, res.stdout + res.stderr
