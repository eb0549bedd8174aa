"""gpuswap: coarse preemption for shared GPU servers.

In a training script, two lines make a job pausable::

    import gpuswap
    job = gpuswap.attach(model=model, optimizer=optimizer)
    for step in range(job.start_step, steps):
        ...
        job.safepoint(step)

Outside gpuswap both calls are cheap no-ops. Importing gpuswap imports neither torch nor the
daemon's web stack.
"""
__version__ = "0.1.0"


def attach(*args, **objects):
    """Attach training state to gpuswap; see gpuswap.runtime.attach."""
    from gpuswap.runtime import attach as _attach

    return _attach(*args, **objects)


__all__ = ["attach", "__version__"]
