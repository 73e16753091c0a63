"""DynamicBatchSFTTrainer on conversational prompt/completion data through the real Qwen3 chat template.

TRL's completion-only masking (its ``completion_mask`` -> ``labels`` preparation) decides the supervised tokens.
(``assistant_only_loss`` needs ``{% generation %}`` markers, which the Qwen3 template shipped here lacks and TRL
cannot patch in.) Run alone or under torchrun:

    python tests/trl_job.py OUT_DIR [padding_free]
Writes OUT_DIR/rank{r}.json: every step's sample ids, its StepInfo loss tokens and the supervised tokens counted
on the collated labels, whether labels outside assistant turns were masked, and the trainer's log history.
"""

import json
import sys
from pathlib import Path

import torch

from evenflow import STEP_INFO_KEY

TURNS = ["hi there", "how are you doing today", "tell me about the weather in a few words please",
         "what is two plus two", "thanks, bye", "can you list three colours", "why is the sky blue"]


def conversations(n: int) -> list:
    out = []
    for i in range(n):
        prompt = [{"role": "user", "content": " ".join(TURNS[(i + t) % len(TURNS)] for t in range(1 + i % 4))}]
        answer = " ".join(TURNS[(i * 3 + t) % len(TURNS)] for t in range(1 + i % 3))
        out.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]})
    return out


def main(out_dir: str, padding_free: bool) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl import SFTConfig

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    args = SFTConfig(output_dir=out_dir, use_cpu=True, report_to="none", num_train_epochs=1, logging_steps=1,
                     gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="constant",
                     save_strategy="no", disable_tqdm=True, max_length=256,
                     padding_free=padding_free, dataloader_pin_memory=False, seed=0)
    steps = []

    class Recording(DynamicBatchSFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            info = inputs[STEP_INFO_KEY]
            labels = inputs["labels"]
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask", torch.ones_like(ids))
            steps.append({"ids": list(info.sample_ids), "idle": info.is_idle, "info_tokens": info.local_loss_tokens,
                          "label_tokens": int((labels[:, 1:] != -100).sum()) if not info.is_idle else None,
                          "masked_real": int(((labels == -100) & (mask == 1)).sum()),
                          "real": info.real_tokens, "global_real": info.global_real_tokens})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Recording(model=model, args=args, train_dataset=Dataset.from_list(conversations(16)),
                        processing_class=tok, token_budget=384)
    trainer.train()
    rank = trainer.args.process_index
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "steps": steps, "logs": trainer.state.log_history, "n": len(trainer.train_dataset),
        "collator": type(trainer.data_collator).__name__, "cost": trainer.loader_options.get("cost", "padded")}))


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "padding_free")
