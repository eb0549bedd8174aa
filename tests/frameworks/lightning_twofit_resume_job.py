"""Two Lightning fits in one process (two models of the same shapes), for an exact-resume check.

    python lightning_twofit_resume_job.py OUT.json     (env PARK=fit:step to preempt there)

Under a (fake) Slurm job with PARK set, Slurm's preemption signal arrives in that fit at that
global step; the runtime checkpoints at the next safepoint and exits 75. The rerun (no PARK)
resumes. OUT.json gets a digest of both models' parameters and of the RNG at the end.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpuswap.lightning import SafepointCallback

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        out = torch.nn.functional.dropout(self.net(batch[0]), 0.2)
        return torch.nn.functional.mse_loss(out, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Preempt(pl.Callback):
    def __init__(self, fit: int, safepoint: SafepointCallback) -> None:
        park = os.environ.get("PARK")
        self.at = tuple(int(x) for x in park.split(":")) if park else None
        self.fit, self.safepoint = fit, safepoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (self.fit, trainer.global_step) == self.at:
            os.kill(os.getpid(), signal.SIGUSR2)
            deadline = time.monotonic() + 120     # the fact: the pause is asked for, no timing window
            while not self.safepoint.job._pending and time.monotonic() < deadline:
                time.sleep(0.001)


pl.seed_everything(0, verbose=False)
data = TensorDataset(torch.randn(48, 4), torch.randn(48, 4))
models = []
for fit in (1, 2):
    model = Tiny()
    safepoint = SafepointCallback()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[safepoint, Preempt(fit, safepoint)])
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
    print(f"fit {fit} done at global step {trainer.global_step}", flush=True)
    models.append(model)
digest = {f"fit{i + 1}.{name}": hashlib.sha256(p.detach().numpy().tobytes()).hexdigest()
          for i, m in enumerate(models) for name, p in m.named_parameters()}
digest["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
with open(sys.argv[1], "w") as f:
    json.dump(digest, f)
