"""Trace-driven discrete-event simulator that drives the same policy core the daemon uses."""
from gpuswap.sim.engine import Cluster, SimError, SimResult, Simulator, simulate  # noqa: F401
