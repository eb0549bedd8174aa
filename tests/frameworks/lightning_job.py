"""A tiny Lightning fit on CPU with gpuswap's SafepointCallback: the job the tests run.

    python lightning_job.py OUT.json      (env FW_PAUSES triggers pauses; FW_ACCEL=gpu: the fit runs on
                                          CUDA in 16-bit mixed precision, with its GradScaler;
                                          FW_KEEP_FREED=1: a mutation, a spill leaves its freed
                                          tensors freed, as before parking.leave_on_host)
"""
from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from fw_common import PauseAt, params_sha256, write_result
from gpuswap.lightning import SafepointCallback

warnings.filterwarnings("ignore")
EPOCHS, N, BATCH = 3, 96, 8  # 12 batches per epoch, 36 steps


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Trigger(pl.Callback):
    def __init__(self, gp: SafepointCallback) -> None:
        self.gp, self.pause = gp, PauseAt()
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(int(batch[0][0, 0].mul(1e4).round().item()))  # which sample came first

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # runs before SafepointCallback's hook (callback order), so the pause is served there
        self.pause.maybe(self.gp.job, trainer.global_step - 1)


def main(out: str) -> int:
    if os.environ.get("FW_KEEP_FREED") == "1":
        from gpuswap.runtime import parking

        parking.leave_on_host = lambda park, tensors: 0
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    gp = SafepointCallback()
    trig = Trigger(gp)
    gpu = os.environ.get("FW_ACCEL") == "gpu"
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="gpu" if gpu else "cpu", devices=1, callbacks=[trig, gp],
                         precision="16-mixed" if gpu else "32-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    model = Tiny()
    trainer.fit(model, loader)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    write_result(out, sha256=params_sha256(model), global_step=trainer.global_step,
                 scale=None if scaler is None else float(scaler.get_scale()),
                 epoch=trainer.current_epoch, restored_step=getattr(gp.job, "restored_step", None),
                 parked_bytes=(gp.job.state.get("fw_parked_bytes", []) if gp.job is not None else []), batches=trig.seen,
                 lr=trainer.optimizers[0].param_groups[0]["lr"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
