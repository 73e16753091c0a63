"""Hugging Face Trainer with evenflow batches: ``DynamicBatchTrainer``.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py                  # CPU (gloo) or GPUs
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --resume last    # continue from a checkpoint

Units: ``max_steps``, ``save_steps``, ``logging_steps`` and the LR schedule count optimizer steps (evenflow
accumulation windows of ``gradient_accumulation_steps`` micro-batches). ``max_steps`` gives an exact schedule;
with ``num_train_epochs`` the horizon HF computes is an upper bound (a warning says so). Training logs carry the
``evenflow/*`` step metrics; ``evaluate`` reports the exact per-token loss over evenflow eval batches.
"""

from __future__ import annotations

import argparse

import torch
from transformers import TrainingArguments

from evenflow.integrations.hf import DynamicBatchTrainer
from _tiny import RandomChat, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'last'")
    cli = parser.parse_args()
    args = TrainingArguments(output_dir=cli.output_dir, use_cpu=not torch.cuda.is_available(), max_steps=cli.max_steps,
                             gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine",
                             warmup_steps=2, logging_steps=5, save_steps=10, report_to="none",
                             dataloader_pin_memory=torch.cuda.is_available(), disable_tqdm=True)
    trainer = DynamicBatchTrainer(model=tiny_llama(), args=args, train_dataset=RandomChat(256),
                                  eval_dataset=RandomChat(64, seed=1), token_budget=256, eval_token_budget=512,
                                  buffer_size=64)
    trainer.train(resume_from_checkpoint=True if cli.resume == "last" else cli.resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print("eval", metrics)


if __name__ == "__main__":
    main()
