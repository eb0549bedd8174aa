"""Two Lightning fits in one process under a (fake) Slurm job, the second one preempted.

    python lightning_twofit_job.py      (env SLURM_JOB_ID, GPUSWAP_SLURM_REQUEUE=exit)

At the end of each fit Lightning's signal teardown puts back the handlers it found when the fit
began; the second fit then sends itself SIGUSR2 (Slurm's preemption signal) at step 5. gpuswap
must still checkpoint at the next safepoint and exit 75, not die of the signal (rc 140).
"""
from __future__ import annotations

import os
import signal
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpuswap.lightning import SafepointCallback

warnings.filterwarnings("ignore")


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Preempt(pl.Callback):
    """In the second fit only: Slurm's preemption signal at step 5."""

    def __init__(self, fit: int) -> None:
        self.fit = fit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.fit == 2 and trainer.global_step == 5:
            print(f"fit 2: SIGUSR2 handler is {signal.getsignal(signal.SIGUSR2)!r}", flush=True)
            os.kill(os.getpid(), signal.SIGUSR2)


loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=4)
for fit in (1, 2):
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Preempt(fit), SafepointCallback()])
    trainer.fit(Tiny(), loader)
    print(f"fit {fit} done", flush=True)
