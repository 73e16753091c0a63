"""DynamicBatchSFTTrainer packing and metrics, run alone or under torchrun (tests/test_trl_packing.py).

    python tests/trl_packing_job.py OUT_DIR VARIANT[,VARIANT...]
VARIANT: ``packing`` (``SFTConfig(packing=True)``), ``padding_free`` (``padding_free=True``), ``summed``
(``cost="summed"`` alone) or ``padded`` (neither: TRL's padded rows under ``cost="padded"``), each with
``max_length=MAX_LENGTH`` and prompt/completion data some of whose samples are longer. Writes
OUT_DIR/VARIANT-rank{r}.json: per micro-batch the StepInfo (sample ids, IDLE, supervised tokens), the collated
tensors' shape, the sequence lengths of the packed row, and the per-token entropy / top-1 hits / supervised tokens
computed here from the model's full logits (not TRL's fused head), plus the trainer's log history.
"""

import json
import sys
from pathlib import Path

import torch

from evenflow import STEP_INFO_KEY

MAX_LENGTH = 48
BUDGET = 160
TURNS = ["hi there", "how are you doing today", "tell me about the weather in a few words please",
         "what is two plus two", "thanks, bye", "can you list three colours", "why is the sky blue"]


def conversations(n: int) -> list:
    out = []
    for i in range(n):
        prompt = [{"role": "user", "content": " ".join(TURNS[(i + t) % len(TURNS)] for t in range(1 + i % 3))}]
        answer = " ".join(TURNS[(i * 3 + t) % len(TURNS)] for t in range(1 + i % 4))
        out.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]})
    return out


def independent_metrics(model, inputs: dict, labels: torch.Tensor) -> dict:
    """Entropy sum, top-1 hits and supervised tokens of one micro-batch from the full logits (float64)."""
    with torch.no_grad():
        forward = {k: v for k, v in inputs.items() if k not in ("labels", STEP_INFO_KEY)}
        target = labels[:, 1:]
        mask = target != -100
        logits = model(**forward).logits[:, :-1][mask].double()  # supervised positions only
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        hits = logits.argmax(-1) == target[mask]
        return {"entropy_sum": float(entropy.sum()), "hits": int(hits.sum()), "count": int(mask.sum())}


def main(out_dir: str, variant: str) -> None:
    import datasets
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl import SFTConfig

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.integrations.trl import DynamicBatchSFTTrainer

    datasets.disable_caching()  # no fingerprint hashing of the 151k-token tokenizer per map (7 s a trainer)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    options = {"packing": {"packing": True}, "padding_free": {"padding_free": True}}.get(variant, {})
    args = SFTConfig(output_dir=out_dir, use_cpu=True, report_to="none", num_train_epochs=1, logging_steps=2,
                     gradient_accumulation_steps=3, learning_rate=2e-2, lr_scheduler_type="constant",
                     save_strategy="no", disable_tqdm=True, max_length=MAX_LENGTH, dataloader_pin_memory=False,
                     seed=0, **options)
    steps = []

    class Recording(DynamicBatchSFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            info = inputs[STEP_INFO_KEY]
            ids = inputs["input_ids"]
            row = {"step": self.state.global_step, "ids": list(info.sample_ids), "idle": info.is_idle,
                   "info_tokens": info.local_loss_tokens, "global_loss": info.global_loss_tokens,
                   "real": info.real_tokens, "global_real": info.global_real_tokens, "shape": list(ids.shape),
                   "attention_mask": "attention_mask" in inputs}
            if "cu_seq_lens_q" in inputs:
                row["seq_lengths"] = inputs["cu_seq_lens_q"].diff().tolist()
            elif "attention_mask" in inputs:
                row["seq_lengths"] = inputs["attention_mask"].sum(1).tolist()
            if not info.is_idle:
                row.update(independent_metrics(self.accelerator.unwrap_model(model), inputs, inputs["labels"]))
                row["label_tokens"] = int((inputs["labels"][:, 1:] != -100).sum())
            steps.append(row)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    kwargs = {"cost": "summed"} if variant == "summed" else {}
    trainer = Recording(model=model, args=args, train_dataset=Dataset.from_list(conversations(40)),
                        processing_class=tok, token_budget=BUDGET, **kwargs)
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    trainer.train()
    rank = trainer.args.process_index
    Path(out_dir, f"{variant}-rank{rank}.json").write_text(json.dumps({
        "steps": steps, "logs": trainer.state.log_history, "n": len(trainer.train_dataset), "lengths": lengths,
        "cost": trainer.loader_options.get("cost", "padded"), "padding_free": bool(trainer.args.padding_free),
        "packing": bool(trainer.args.packing), "max_length": trainer.args.max_length}))


if __name__ == "__main__":
    for name in sys.argv[2].split(","):
        main(sys.argv[1], name)
