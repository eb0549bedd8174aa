"""A tiny Hugging Face Trainer run on CPU with gpuswap's SafepointCallback (no hub access: the
model is built from a config, the data is synthetic).

    python hf_job.py OUT.json      (env FW_PAUSES triggers pauses, see fw_common.PauseAt;
                                   FW_ACCEL=gpu: on CUDA in fp16, with full determinism)

`FW_HF_EVAL=1`: evaluate every 8 steps on a held-out set (evaluation iterates a DataLoader, which
draws from the global RNG, so a resume that skips or repeats one shifts dropout afterwards).
`FW_HF_EVAL=start`: and evaluate once before the first step too (`eval_on_start`).
`FW_HF_EVAL=early`: and stop early: with patience 3 and a threshold no eval loss improves by, the
evaluations at steps 16, 24 and 32 count against the patience and training stops at step 32.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from transformers import (BertConfig, BertForSequenceClassification, EarlyStoppingCallback, Trainer,
                          TrainerCallback, TrainingArguments)
from transformers.utils import logging as hf_logging

from fw_common import PauseAt, params_sha256, write_result
from gpuswap.hf import SafepointCallback

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
N, SEQ, EPOCHS, BATCH = 96, 12, 3, 8  # 12 steps per epoch, 36 steps
EVAL = (dict(eval_strategy="steps", eval_steps=8, per_device_eval_batch_size=8)
        if os.environ.get("FW_HF_EVAL") else {})
EARLY = os.environ.get("FW_HF_EVAL") == "early"
GPU = os.environ.get("FW_ACCEL") == "gpu"   # on CUDA in fp16 (the Trainer's GradScaler), deterministic
if os.environ.get("FW_HF_EVAL") == "start":
    EVAL.update(eval_on_start=True)
if EARLY:
    EVAL.update(metric_for_best_model="eval_loss", greater_is_better=False)


class Trigger(TrainerCallback):
    def __init__(self, gp: SafepointCallback) -> None:
        self.gp, self.pause = gp, PauseAt()

    def on_step_end(self, args, state, control, **kwargs):
        # asks before SafepointCallback marks the step due; the pause is served at its safepoint
        self.pause.maybe(self.gp.job, state.global_step - 1)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = N, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, SEQ), generator=g)
        self.labels = (self.ids.sum(1) % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

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
                             save_strategy="no", report_to=[], logging_strategy="no", use_cpu=not GPU,
                             fp16=GPU, full_determinism=GPU,
                             dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False,
                             **EVAL)
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(cfg)
    gp = SafepointCallback()
    trig = Trigger(gp)
    trainer = Trainer(model=model, args=args, train_dataset=Data(),
                      eval_dataset=Data(16, seed=1) if EVAL else None, data_collator=collate,
                      callbacks=[trig, gp] + ([EarlyStoppingCallback(3, 1.0)] if EARLY else []))
    trainer.train()
    write_result(out, sha256=params_sha256(model), global_step=trainer.state.global_step,
                 epoch=trainer.state.epoch, restored_step=getattr(gp.job, "restored_step", None),
                 parked_bytes=(gp.job.state.get("fw_parked_bytes", []) if gp.job is not None else []), samples=SEEN,
                 lr=trainer.optimizer.param_groups[0]["lr"],
                 scale=(float(trainer.accelerator.scaler.get_scale())
                        if getattr(trainer.accelerator, "scaler", None) is not None else None),
                 evals=[(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
