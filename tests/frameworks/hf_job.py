"""A tiny Hugging Face Trainer run on CPU with gpuswap's SafepointCallback (no hub access: the
model is built from a config, the data is synthetic).

    python hf_job.py OUT.json      (env FW_PAUSE_AT / FW_PAUSE_TIER trigger a pause)
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from fw_common import PauseAt, params_sha256, write_result
from gpuswap.hf import SafepointCallback

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
N, SEQ, EPOCHS, BATCH = 96, 12, 3, 8  # 12 steps per epoch, 36 steps


class Trigger(TrainerCallback):
    def __init__(self, gp: SafepointCallback) -> None:
        self.gp, self.pause = gp, PauseAt()

    def on_step_end(self, args, state, control, **kwargs):
        # runs before SafepointCallback's hook (callback order), so the pause is served there
        self.pause.maybe(self.gp.job, state.global_step - 1)


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (N, SEQ), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.labels[i], "idx": i}


SEEN: list[int] = []  # dataset indices, in the order the collator saw them


def collate(rows: list[dict]) -> dict:
    SEEN.extend(int(r["idx"]) for r in rows)
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows])}


def main(out: str) -> int:
    torch.set_num_threads(1)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=SEQ, num_labels=2)
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out) or ".", "hf-out"),
                             per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS, seed=7,
                             learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=4,
                             save_strategy="no", report_to=[], logging_strategy="no", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False)
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(cfg)
    gp = SafepointCallback()
    trig = Trigger(gp)
    trainer = Trainer(model=model, args=args, train_dataset=Data(), data_collator=collate,
                      callbacks=[trig, gp])
    trainer.train()
    write_result(out, sha256=params_sha256(model), global_step=trainer.state.global_step,
                 epoch=trainer.state.epoch, restored_step=getattr(gp.job, "restored_step", None),
                 parked_bytes=(gp.job.state.get("fw_parked_bytes", []) if gp.job is not None else []), samples=SEEN,
                 lr=trainer.optimizer.param_groups[0]["lr"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
