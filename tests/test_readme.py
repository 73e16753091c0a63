"""The README's front door cannot rot: its commands exist, its usage snippet runs, its demo rows are real.

The quick start itself (``evenflow demo --quick``, what ``make demo`` runs at full size) runs end to end in
tests/test_cli.py::test_demo_quick_end_to_end.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_two_commands_exist_and_ci_runs_the_test_command():
    assert "make demo" in README and "make test" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, re.M) and re.search(r"^demo:", makefile, re.M)
    assert "evenflow demo" in makefile.split("\ndemo:")[1].split("\n\n")[0]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_usage_snippet_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)

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


def test_demo_table_in_readme_has_the_rows_the_demo_prints():
    for row in ("samples/s", "real tokens/s", "padded efficiency", "steps", "rank imbalance (max/mean)",
                "held-out loss / token", "faster than fixed batching", "square-root scaling"):
        assert row in README, row
