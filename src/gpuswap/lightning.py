"""Lightning integration: `Trainer(callbacks=[SafepointCallback()])` makes a fit pausable.

    from gpuswap.lightning import SafepointCallback
    trainer = L.Trainer(..., callbacks=[SafepointCallback()])

At the start of training the callback attaches the LightningModule, every optimizer, LR
scheduler and the precision plugin's GradScaler, plus Lightning's own checkpoint dict (loops,
epoch, global step, callbacks' state) as one more object; `safepoint(global_step - 1)` runs at
the end of every training batch, where Lightning's own ModelCheckpoint saves too.

Resume after a disk park goes through Lightning's restore path, fed from the gpuswap
checkpoint (one format, written atomically with a checksum) instead of a `ckpt_path`: in
`setup` the callback hands Lightning the checkpoint dict it would have read from a file, so
Lightning restores the module, optimizers, schedulers, scaler, loops and callbacks itself. The
global RNGs come back from the gpuswap checkpoint. For the data position, Lightning restarts a
plain DataLoader at the beginning of the epoch; the callback instead replays the interrupted
epoch's sampler from the RNG state that epoch started with and skips the batches already
trained on, so shuffling and position match the uninterrupted run (the skipped batches are
loaded again, as Hugging Face's `skip_first_batches` does).

With `strategy="ddp"` (a plain-script launch, where rank 0 starts the other ranks, or under
torchrun) every rank's callback attaches, the DDP wrapper (`trainer.strategy.model`) in place of
the bare module so the runtime rebinds it after the group is made again; the safepoints are at
the same optimizer steps on every rank, so their ticks agree; `on_train_end` says `done`.
Lightning's own collectives pass `group=None` or `torch.distributed.group.WORLD`, which resolve to
the current default group at each call, so nothing of Lightning's needs rebinding (its
`_InfiniteBarrier` group lives only during `prepare_data`).

Importing gpuswap never imports Lightning; only this module does.
"""
from __future__ import annotations

import sys
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch

import gpuswap
from gpuswap.runtime import prerestore
from gpuswap.runtime.attaching import current_config

STATE_NAME = "lightning"          # the attach name of Lightning's checkpoint dict
EPOCH_RNG = "gpuswap/epoch_rng"   # job.state key: torch CPU RNG state when the epoch began


class _TrainerState:
    """Lightning's full checkpoint dict, attachable. Restored through Lightning in `setup`, so
    `load_state_dict` has nothing left to do."""

    def __init__(self, trainer: "pl.Trainer") -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _SkipFirst:
    """Iterate `loader` as the interrupted epoch did (same sampler RNG), minus `n` batches."""

    def __init__(self, loader: Any, n: int, epoch_rng: torch.Tensor) -> None:
        self.loader, self.n, self.epoch_rng = loader, n, epoch_rng

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if not self.n:  # an epoch boundary: the restored RNG is the one the epoch starts from
            yield from self.loader
            return
        now = torch.get_rng_state()
        torch.set_rng_state(self.epoch_rng)
        it = iter(self.loader)
        for _ in range(self.n):
            next(it)
        torch.set_rng_state(now)  # the restored mid-epoch state: dropout etc. continue exactly
        yield from it


class SafepointCallback(pl.Callback):
    """Attach the trainer's state to gpuswap and call the safepoint after every training batch."""

    def __init__(self) -> None:
        self.job: Any = None
        self._resumed_epoch = False
        self._restored = False
        self._fit_rng: Optional[torch.Tensor] = None
        self._original_loaders: Optional[list[Any]] = None

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        config = current_config()
        if config is None or not config.ckpt_dir:
            return
        saved = prerestore.saved_state(config, STATE_NAME)  # none usable: exits, never a silent restart
        if saved is None:
            return
        if saved.own is None:
            print("gpuswap: the checkpoint has no Lightning state; not restoring it", file=sys.stderr)
            return
        connector = trainer._checkpoint_connector
        if connector._loaded_checkpoint:
            print("gpuswap: a ckpt_path was given too; the gpuswap checkpoint wins", file=sys.stderr)
        connector._loaded_checkpoint = saved.own  # Lightning restores from it as from a file
        self._restored = True

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Several processes (strategy="ddp"): the DDP wrapper Lightning built holds the module
        # (the same parameters and buffers) and the reducer the runtime rebinds after a regroup.
        wrapper = trainer.strategy.model if trainer.world_size > 1 else None
        objects: dict[str, Any] = {"model": wrapper if isinstance(wrapper, torch.nn.Module) else pl_module}
        for i, opt in enumerate(trainer.optimizers):
            objects[f"optimizer{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            objects[f"scheduler{i}"] = cfg.scheduler
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        objects[STATE_NAME] = _TrainerState(trainer)
        self.job = gpuswap.attach(**objects)
        if not self._restored or getattr(self.job, "restored_step", None) is None:
            return
        # Lightning created the epoch's iterator in setup_data, before attach restored the RNG:
        # recreate it, replaying the interrupted epoch's shuffle and skipping what was trained.
        progress = trainer.fit_loop.epoch_loop.batch_progress
        skip = 0 if progress.is_last_batch else progress.current.processed
        if not skip or EPOCH_RNG not in self.job.state:
            skip, self.job.state[EPOCH_RNG] = 0, torch.get_rng_state()
        combined = trainer.fit_loop._combined_loader
        self._original_loaders = combined.flattened
        combined.flattened = [_SkipFirst(dl, skip, self.job.state[EPOCH_RNG])
                              for dl in combined.flattened]
        iter(trainer.fit_loop._data_fetcher)
        self._resumed_epoch = True

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_rng = torch.get_rng_state()  # what the first epoch's shuffle will draw from

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.job is None or not self.job.inside:
            return
        if self._resumed_epoch:  # keeps the RNG state it originally started with
            self._resumed_epoch = False
        else:
            rng, self._fit_rng = self._fit_rng, None
            self.job.state[EPOCH_RNG] = rng if rng is not None else torch.get_rng_state()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        # Only at optimizer-step boundaries: accumulated gradients are not checkpointed.
        if self.job is not None and not trainer.fit_loop.epoch_loop._should_accumulate():
            self.job.safepoint(trainer.global_step - 1)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._original_loaders is not None:
            trainer.fit_loop._combined_loader.flattened = self._original_loaders
            self._original_loaders = None

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # A rank of a multi-rank job says `done`: a pause asked now would wait for a safepoint
        # this rank never reaches again, so the job stops being pausable (runtime/ranks.py).
        if getattr(self.job, "world_size", 1) > 1:
            self.job.close()


__all__ = ["SafepointCallback"]
