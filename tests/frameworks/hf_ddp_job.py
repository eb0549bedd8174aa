"""A tiny Hugging Face Trainer run on 2 CPU processes (gloo; the DDP wrapper is accelerate's) with
gpuswap's SafepointCallback: the job tests/frameworks/test_hf_ddp.py runs, as a torchrun worker,
under a real daemon and, as the reference, outside gpuswap.

    torchrun --nproc-per-node 2 hf_ddp_job.py OUT_DIR      (env FW_HOLD_AT: steps to wait at for a pause)

Each rank writes OUT_DIR/rank{R}.json: digests of its parameters, optimizer state and RNG state,
its global step, the safepoint ticks it counted, and the samples it trained on; then it destroys
its group and leaves with os._exit (a gloo group's destructor can deadlock at exit: pytorch#56297).
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from fw_common import digest, hold_until_pause_asked, write_result
from gpuswap.hf import SafepointCallback

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
N, SEQ, EPOCHS, BATCH, ACCUMULATE = 96, 12, 2, 4, 2  # 2 ranks: 16 samples per step, 6 steps per epoch, 12


class Trigger(TrainerCallback):
    def __init__(self, gp: SafepointCallback) -> None:
        self.gp = gp

    def on_step_end(self, args, state, control, **kwargs):
        # holds until the pause reached this rank; it is served at this step's safepoint
        hold_until_pause_asked(self.gp.job, state.global_step - 1)


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (N, SEQ), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i], "idx": i}


SEEN: list[int] = []  # dataset indices, in the order this rank's collator saw them


def collate(rows: list[dict]) -> dict:
    SEEN.extend(int(r["idx"]) for r in rows)
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows])}


def main(out: str) -> None:
    torch.set_num_threads(1)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=SEQ, num_labels=2)
    args = TrainingArguments(output_dir=os.path.join(out, "hf-out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATE, num_train_epochs=EPOCHS, seed=7,
                             learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2,
                             save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
                             ddp_backend="gloo")
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(cfg)
    gp = SafepointCallback()
    trainer = Trainer(model=model, args=args, train_dataset=Data(), data_collator=collate,
                      callbacks=[Trigger(gp), gp])
    trainer.train()
    rank = args.process_index
    Path(out).mkdir(parents=True, exist_ok=True)
    write_result(os.path.join(out, f"rank{rank}.json"), rank=rank, world=args.world_size,
                 wrapper=type(trainer.model_wrapped).__name__, global_step=trainer.state.global_step,
                 epoch=trainer.state.epoch, params=digest(model.state_dict()),
                 optimizer=digest(trainer.optimizer.state_dict()), rng=digest(torch.get_rng_state()),
                 lr=trainer.optimizer.param_groups[0]["lr"], samples=SEEN,
                 ticks=getattr(gp.job, "tick", None), job=type(gp.job).__name__,
                 restored_step=getattr(gp.job, "restored_step", None))
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
