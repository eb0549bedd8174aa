"""`attach()`: which handle a process gets, and what it is wired to.

The one module that knows every part of the runtime: the configuration (the supervisor's or
Slurm's), the single-rank handle and its park path (`pausing.py`), a rank's handle (`ranks.py`),
Slurm's signals and requeue (`slurm.py`) and the control channel. The handle itself imports none
of them: what it must call (the park at a safepoint, the requeue before exit 75) it is given here.
The heavier parts are imported only inside a job, so `import gpuswap` stays cheap.
"""
from __future__ import annotations

import atexit
from typing import Any, Callable

from gpuswap.runtime.config import RuntimeConfig
from gpuswap.runtime.handle import Job, NullJob
from gpuswap.runtime.objects import classify, is_plain, signature

_active: Job | None = None
_attaches = 0     # attaches inside gpuswap so far in this process: each checkpoint records its attach's
_signatures: list[str] = []    # objects.signature of each of them, in order (checkpoints keep them)


def next_attach() -> int:
    """The number the next `attach()` of this process will have (1 for the first). A checkpoint
    is restored only by the attach of the number that wrote it (checkpoint.other_attach); the
    framework callbacks ask this before their pre-attach restore (runtime/prerestore.py)."""
    return _attaches + 1


def current_config() -> RuntimeConfig | None:
    """This process's runtime config: the supervisor's (a daemon job), else Slurm's (a Slurm job
    runs the runtime standalone), else None (outside gpuswap). `attach` and the framework
    callbacks' pre-attach restore read it the same way."""
    config = RuntimeConfig.from_env()
    if config.job_id is not None:
        return config
    from gpuswap.runtime import slurm

    return slurm.config_from_env()


def attach(*args: Any, **objects: Any) -> Job | NullJob:
    """Attach training state; returns the handle with `start_step`, `safepoint`, `state`.

    Outside gpuswap (no `$GPUSWAP_JOB_ID`) this is a no-op handle and torch is not imported.
    Inside, a checkpoint in `$GPUSWAP_CKPT_DIR` is restored into the objects in place first.
    Positional objects are checkpointed as arg0, arg1, ...; keyword names must stay stable
    across restarts.

    Plain immutable values (`epoch=3`) cannot be restored in place: they go into `job.state`
    under their name, and `job.state[name]` is the value to use (the restored one after a
    checkpoint, else the one given). What can be neither restored nor kept raises the same
    TypeError inside and outside gpuswap, so a script never behaves differently under the daemon.
    """
    named = {f"arg{i}": obj for i, obj in enumerate(args)}
    named.update(objects)
    plain = {name: obj for name, obj in named.items() if is_plain(obj)}
    items = [classify(name, obj) for name, obj in named.items() if name not in plain]
    config = current_config()
    if config is None:
        return NullJob(plain)
    global _active, _attaches, _signatures
    _attaches += 1
    _signatures = _signatures[:_attaches - 1] + [signature(items, plain)]
    who = None
    if config.control:     # under Slurm only a rank of a multi-rank job has one (runtime/slurm.py)
        from gpuswap.runtime import ranks

        who = ranks.identity(group=ranks.default_group())
        if config.slurm and who.world_size > 1:
            from gpuswap.runtime import slurm

            slurm.coordinate(config, who)   # rank 0 of `srun --ntasks N` serves the coordinator
    if config.slurm:
        from gpuswap.runtime import slurm

        slurm.catch_early(who)      # a signal during the restore below waits for the job
    job = _handle(items, config, who, _attaches)
    # A restart that skipped finished phases resumed a later attach's checkpoint here: count on
    # from that attach, as the process that wrote it did (pausing.restore_latest).
    _attaches, _signatures = job.attach_no, list(job.attach_sigs)
    for name, value in plain.items():
        job.state.setdefault(name, value)   # a restored value wins over the one given
    job.measure()  # what `hello` reports: the reader thread must not walk the tensors itself
    job.request_measure()   # and again at the first safepoint, once the first step made the optimizer's state
    if _active is not None:
        _active.close()
    _active = job
    if config.control:
        job.connect(config.control)
    if config.slurm:
        from gpuswap.runtime import slurm

        slurm.install(job)
    return job


def _handle(items: list[Any], config: RuntimeConfig, who: Any, attach_no: int) -> Job:
    """The handle, wired and restored: a rank's (`ranks.py`) for a multi-rank job, else the
    single-rank one whose pauses `pausing.py` serves. `attach_no`: which attach of the process
    this is; its checkpoints say so, and it restores only a checkpoint of its own number."""
    before_exit = _slurm_requeue(config) if config.slurm else None
    if who is not None and who.world_size > 1:     # a rank of a multi-rank job (runtime/ranks.py)
        from gpuswap.runtime import ranks

        job: Job = ranks.RankJob(items, config, who, before_exit=before_exit)
        job.attach_no, job.attach_sigs = attach_no, tuple(_signatures)
        ranks.restore_ranks(job)
        atexit.register(job.close)
        return job
    from gpuswap.runtime import pausing

    job = Job(items, config, serve_pause=pausing.serve, before_exit=before_exit)
    job.attach_no, job.attach_sigs = attach_no, tuple(_signatures)
    if config.ckpt_dir:
        pausing.restore_latest(job)
    return job


def _slurm_requeue(config: RuntimeConfig) -> Callable[[], None]:
    """Before exit 75 under Slurm: the job asks to be requeued (`slurm.requeue`)."""
    from gpuswap.runtime import slurm

    def requeue() -> None:
        slurm.requeue(config)

    return requeue
