"""The in-job runtime: `attach` returns a handle whose `safepoint(step)` pauses the job when the
supervisor asks (parking GPU memory in host RAM, or checkpointing to disk and exiting 75).

Importing this package imports neither torch nor NumPy.
"""
from gpuswap.runtime.attaching import attach
from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.handle import Job, NullJob

__all__ = ["attach", "Job", "NullJob", "RuntimeConfig"]
