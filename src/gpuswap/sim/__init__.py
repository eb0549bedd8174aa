"""Trace-driven discrete-event simulator that drives the same policy core the daemon uses.

The engine lives in `gpuswap.sim.engine`; it is not imported here, so that registering the
`sim` verb (on every CLI call) does not pay for NumPy."""
