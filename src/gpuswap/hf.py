"""Hugging Face integration: `Trainer(..., callbacks=[SafepointCallback()])` makes training pausable.

    from gpuswap.hf import SafepointCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SafepointCallback()])

At `on_train_begin` the callback attaches the model, the optimizer, the LR scheduler and the
Trainer's own resumable state; `safepoint(global_step - 1)` runs at every `on_step_end`, i.e.
after each optimizer step, where the Trainer itself would save a checkpoint.

The Trainer's own state is what `Trainer._save_checkpoint` writes (weights, optimizer,
scheduler, scaler, RNG states, trainer_state.json with global step, epoch and callbacks'
state), captured as bytes inside the gpuswap checkpoint: one atomic, checksummed file, no
second checkpoint on disk. After a disk park, the restarted job's `Trainer.__init__` reaches
the callback's `on_init_end`; the callback unpacks those files into a private temporary
directory and makes `trainer.train()` resume from it when the script passes no
`resume_from_checkpoint` of its own. So resuming uses the Trainer's `resume_from_checkpoint`
semantics exactly: global step, epoch, skipping the batches already seen in the current epoch
(same sampler seed), RNG states.

Under torchrun or `accelerate launch` with several processes every rank's callback attaches,
`trainer.model_wrapped` (the DDP wrapper accelerate built) in place of the bare model, so the
runtime rebinds it after the process group is made again; `on_step_end` runs at the same
optimizer steps on every rank, so the safepoint ticks agree; `on_train_end` says `done`. Neither
the Trainer nor accelerate keeps a process group object of its own (their collectives use the
default group, resolved at each call).

Importing gpuswap never imports transformers; only this module does.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback

import gpuswap
from gpuswap.runtime import prerestore
from gpuswap.runtime.attaching import current_config

STATE_NAME = "hf_trainer"  # attach name of the Trainer's checkpoint files
TRAINER_STATE = "trainer_state.json"


class _TrainerFiles:
    """The files Trainer._save_checkpoint would write, as {relative path: bytes}."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        tmp = tempfile.mkdtemp(prefix="gpuswap-hf-save-")
        try:
            t.save_model(tmp, _internal_call=True)
            t._save_optimizer_and_scheduler(tmp)
            t._save_scaler(tmp)
            t._save_rng_state(tmp)
            t.state.save_to_json(os.path.join(tmp, TRAINER_STATE))
            root = Path(tmp)
            return {"files": {str(p.relative_to(root)): p.read_bytes()
                              for p in sorted(root.rglob("*")) if p.is_file()}}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # restored by the Trainer itself, through resume_from_checkpoint (on_init_end)


def _unpack(files: dict[str, bytes]) -> str:
    d = tempfile.mkdtemp(prefix="gpuswap-hf-resume-")
    atexit.register(shutil.rmtree, d, True)
    for rel, data in files.items():
        path = Path(d) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return d


def _calling_trainer() -> Optional[Trainer]:
    """The Trainer whose __init__ is calling on_init_end (callbacks are not given it)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    return None


class SafepointCallback(TrainerCallback):
    """Attach the Trainer's state to gpuswap and call the safepoint after every optimizer step."""

    def __init__(self) -> None:
        self.job: Any = None
        self.trainer: Optional[Trainer] = None
        self.resume_dir: Optional[str] = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer = _calling_trainer()
        config = current_config()
        if self.trainer is None or config is None or not config.ckpt_dir:
            return
        saved = prerestore.saved_state(config, STATE_NAME)  # none usable: exits, never a silent restart
        if saved is None or saved.own is None:
            return
        # Several processes: the Trainer saved weights, optimizer, scheduler and scaler from the
        # main process only, and rng_state_{rank}.pth on every rank, but every rank loads them all
        # from the directory it resumes from: rank 0's files, then this rank's own over them.
        files = dict(saved.rank0["files"]) if saved.rank0 is not None else {}
        files.update(saved.own["files"])
        self.resume_dir = _unpack(files)
        train = self.trainer.train

        @functools.wraps(train)
        def train_resuming(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
            if resume_from_checkpoint is None:
                resume_from_checkpoint = self.resume_dir
            return train(resume_from_checkpoint, *a, **kw)

        self.trainer.train = train_resuming  # type: ignore[method-assign]

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None:
            print("gpuswap: SafepointCallback could not find its Trainer; not attached", file=sys.stderr)
            return
        model = kwargs.get("model") or trainer.model
        wrapped = getattr(trainer, "model_wrapped", None)
        if trainer.args.world_size > 1 and isinstance(wrapped, torch.nn.Module) and wrapped is not model:
            # Several processes: the wrapper accelerate built (DDP) holds the model (the same
            # parameters and buffers) and the reducer the runtime rebinds after a regroup.
            model = wrapped
        objects: dict[str, Any] = {"model": model}
        opt = kwargs.get("optimizer") or trainer.optimizer
        if opt is not None:
            objects["optimizer"] = getattr(opt, "optimizer", opt)  # unwrap accelerate's wrapper
        sched = kwargs.get("lr_scheduler") or trainer.lr_scheduler
        if sched is not None:
            objects["scheduler"] = sched
        objects[STATE_NAME] = _TrainerFiles(trainer)
        self.job = gpuswap.attach(**objects)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.job is not None:
            self.job.safepoint(state.global_step - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A rank of a multi-rank job says `done`: a pause asked now would wait for a safepoint
        # this rank never reaches again, so the job stops being pausable (runtime/ranks.py).
        if getattr(self.job, "world_size", 1) > 1:
            self.job.close()


__all__ = ["SafepointCallback"]
