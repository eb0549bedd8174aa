"""A tiny Lightning fit with `strategy="ddp"` on 2 CPU processes (gloo) and gpuswap's
SafepointCallback: the job tests/frameworks/test_lightning_ddp.py runs under a real daemon and, as
the reference, outside gpuswap. A plain-script launch: this process is rank 0 and Lightning starts
rank 1 itself (the same script, LOCAL_RANK=1).

    python lightning_ddp_job.py OUT_DIR      (env FW_HOLD_AT: steps to wait at for a pause)

Each rank writes OUT_DIR/rank{R}.json: digests of its parameters, optimizer state and RNG state,
its global step, the safepoint ticks it counted, and the batches it trained on. It leaves with
os._exit after destroying its group (a gloo group's destructor can deadlock at exit:
pytorch#56297); rank 0 first waits for the rank it started.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from fw_common import digest, hold_until_pause_asked, write_result
from gpuswap.lightning import SafepointCallback

warnings.filterwarnings("ignore")
EPOCHS, N, BATCH, ACCUMULATE = 3, 64, 4, 2  # per rank: 8 batches, 4 optimizer steps per epoch; 12 steps


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)   # one of Lightning's own collectives, every batch
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Trigger(pl.Callback):
    def __init__(self, gp: SafepointCallback) -> None:
        self.gp = gp
        self.seen: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(int(batch[0][0, 0].mul(1e4).round().item()))  # which sample came first

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # runs before SafepointCallback's hook (callback order), so the pause is served there
        if not trainer.fit_loop.epoch_loop._should_accumulate():
            hold_until_pause_asked(self.gp.job, trainer.global_step - 1)


def main(out: str) -> int:
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    gp = SafepointCallback()
    trig = Trigger(gp)
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=2, strategy="ddp",
                         accumulate_grad_batches=ACCUMULATE, callbacks=[trig, gp], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         deterministic=True)
    model = Tiny()
    trainer.fit(model, loader)
    rank = trainer.global_rank
    opt = trainer.optimizers[0]
    Path(out).mkdir(parents=True, exist_ok=True)
    write_result(os.path.join(out, f"rank{rank}.json"), rank=rank, global_step=trainer.global_step,
                 epoch=trainer.current_epoch, params=digest(model.state_dict()), optimizer=digest(opt.state_dict()),
                 rng=digest(torch.get_rng_state()), lr=opt.param_groups[0]["lr"], batches=trig.seen,
                 ticks=getattr(gp.job, "tick", None), job=type(gp.job).__name__,
                 restored_step=getattr(gp.job, "restored_step", None))
    torch.distributed.destroy_process_group()
    if rank == 0:
        for child in getattr(trainer.strategy.launcher, "procs", []):
            child.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
