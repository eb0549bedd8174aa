"""Hugging Face integration: `Trainer(..., callbacks=[SafepointCallback()])` makes training pausable.

    from gpuswap.hf import SafepointCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SafepointCallback()])

At `on_train_begin` the callback attaches the model, the optimizer, the LR scheduler and the
Trainer's own resumable state; `safepoint(global_step - 1)` runs after each optimizer step once the
Trainer has logged, evaluated and saved for it (`_maybe_log_save_evaluate`, which follows
`on_step_end`; after the last step of an epoch, also the epoch's own): where the Trainer's own
checkpoint is written, and what its resume continues from. It is served just before the Trainer
fetches the next step's batches (`get_batch_samples`), or at `on_epoch_begin` before the next
epoch's iterator draws its seed; after the step that ends training there is none.

The Trainer's own state is what `Trainer._save_checkpoint` writes (weights, optimizer,
scheduler, scaler, RNG states, trainer_state.json with global step, epoch and callbacks'
state), captured as bytes inside the gpuswap checkpoint: one atomic, checksummed file, no
second checkpoint on disk. After a disk park, the restarted job's `Trainer.__init__` reaches
the callback's `on_init_end`, which wraps `trainer.train`; when the script calls it with no
`resume_from_checkpoint` of its own and the checkpoint is this train()'s to restore (the attach it
makes is the one that wrote it: a script may train several times), the callback unpacks those
files into a private temporary directory and the Trainer resumes from it. So resuming uses the Trainer's `resume_from_checkpoint`
semantics exactly: global step, epoch, skipping the batches already seen in the current epoch
(same sampler seed), RNG states; and the stateful callbacks' state (EarlyStoppingCallback's
patience, TrainerControl), captured as it is at the safepoint and restored whatever
`restore_callback_states_from_checkpoint` says.

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
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

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
            # The stateful callbacks' state as it is now (EarlyStoppingCallback's patience, the
            # TrainerControl): `TrainerState.stateful_callbacks` is refreshed only by the
            # Trainer's own `_save_checkpoint`; a copy, so the Trainer's state is left as it was.
            stateful = [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]
            state = dataclasses.replace(t.state, stateful_callbacks=stateful)
            state.save_to_json(os.path.join(tmp, TRAINER_STATE))
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
        self._due: Optional[int] = None   # the step whose safepoint waits for the Trainer's log/eval/save

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer = _calling_trainer()
        config = current_config()
        if self.trainer is None or config is None or not config.ckpt_dir:
            return
        trainer = self.trainer
        train = trainer.train

        @functools.wraps(train)
        def train_resuming(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
            # Asked here, not at init: the checkpoint is restored only by the attach of the number
            # that wrote it (checkpoint.other_attach), and this train()'s on_train_begin makes the
            # next attach; Trainers built before an earlier one trains would count wrong at init.
            if resume_from_checkpoint is not None:
                return train(resume_from_checkpoint, *a, **kw)
            resume_dir = self._resume_dir(config)
            if resume_dir is None:
                return train(*a, **kw)
            # The callbacks' state too, whatever `restore_callback_states_from_checkpoint` says
            # (default False): an uninterrupted run never forgets its early-stopping patience.
            # And no second `eval_on_start`: the run evaluated before its first step already,
            # and the restored log history holds that evaluation.
            args = trainer.args
            before = args.restore_callback_states_from_checkpoint, args.eval_on_start
            args.restore_callback_states_from_checkpoint, args.eval_on_start = True, False
            try:
                return train(resume_dir, *a, **kw)
            finally:
                args.restore_callback_states_from_checkpoint, args.eval_on_start = before

        trainer.train = train_resuming  # type: ignore[method-assign]

    def _resume_dir(self, config: Any) -> Optional[str]:
        """The Trainer's checkpoint files from the gpuswap checkpoint the coming attach restores,
        unpacked; None if it restores none."""
        saved = prerestore.saved_state(config, STATE_NAME)  # none usable: exits, never a silent restart
        if saved is None or saved.own is None:
            return None
        # Several processes: the Trainer saved weights, optimizer, scheduler and scaler from the
        # main process only, and rng_state_{rank}.pth on every rank, but every rank loads them all
        # from the directory it resumes from: rank 0's files, then this rank's own over them.
        files = dict(saved.rank0["files"]) if saved.rank0 is not None else {}
        files.update(saved.own["files"])
        self.resume_dir = _unpack(files)
        return self.resume_dir

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
        self._due = None
        fetch = trainer.get_batch_samples
        if not getattr(fetch, "_gpuswap_safepoint", False):
            @functools.wraps(fetch)
            def fetch_after_safepoint(*a: Any, **kw: Any) -> Any:
                self._serve_due()
                return fetch(*a, **kw)

            fetch_after_safepoint._gpuswap_safepoint = True  # type: ignore[attr-defined]
            trainer.get_batch_samples = fetch_after_safepoint  # type: ignore[method-assign]

    def _serve_due(self) -> None:
        step, self._due = self._due, None
        if step is not None and self.job is not None:
            self.job.safepoint(step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Not here: the Trainer logs, evaluates (drawing from the global RNG: its DataLoader's
        # seed) and saves for this step after on_step_end, and a run resumed from here would
        # start at the next step without them. The safepoint is served once they are done.
        if self.job is not None:
            self._due = state.global_step - 1

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._serve_due()   # the last step of the previous epoch, after the epoch's own eval/save

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._due = None   # training is over: nothing left to resume
        # A rank of a multi-rank job says `done`: a pause asked now would wait for a safepoint
        # this rank never reaches again, so the job stops being pausable (runtime/ranks.py).
        if getattr(self.job, "world_size", 1) > 1:
            self.job.close()


__all__ = ["SafepointCallback"]
