"""The budget recommender's memory model (evenflow.memory) against real forward+backward passes.

Each measurement runs in a fresh subprocess (tests/budget_probe.py): a Llama and a Qwen3 shape from their HF
configs (float32, sdpa, AdamW, no weights downloaded), peak RSS over one forward+backward. The model's
constants come from counting tensors (NOTE [ Memory model ]), not from these runs. Measured on this machine
(2 cores, float32, glibc): activations -6.6 % for the Llama shape (-3.4 % with activation checkpointing,
measured during development) and -12.7 % .. -13.6 % for the Qwen3 shape (the model undercounts; the recommender's default 10 % headroom
covers the Llama gap, not all of Qwen3's); static memory exact. The bound asserted is 20 %.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from evenflow.memory import ModelShape, estimate_memory, recommend_token_budget

PROBE = Path(__file__).with_name("budget_probe.py")
SHAPES = {
    "llama": dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", vocab_size=16000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False),
}
MAX_ERROR = 0.20


def _measure(config: dict, tokens: int, checkpointing: bool) -> dict:
    cmd = [sys.executable, str(PROBE), json.dumps(config), str(tokens)] + (["checkpointing"] if checkpointing else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the 'hf' extra")
# Two shapes, each a fresh subprocess (~10 s). The checkpointing variant (("llama", 2048, True): measured -3.4 %)
# is left out of the default run for suite time; test_recommendation_fits_and_scales covers its arithmetic.
@pytest.mark.parametrize("name,tokens,checkpointing", [("llama", 2048, False), ("qwen3", 1024, False)])
def test_memory_model_matches_measured_peak(name, tokens, checkpointing):
    config = SHAPES[name]
    measured = _measure(config, tokens, checkpointing)
    shape = ModelShape.from_hf_config(config, activation_checkpointing=checkpointing)
    estimate = estimate_memory(shape, tokens)
    assert shape.parameters() == measured["params"]
    # weights + gradients + AdamW moments; AdamW's per-tensor step counters (a few bytes each) are not modelled
    assert estimate.static == pytest.approx(measured["static"], rel=1e-5)
    # The measurement is valid only if the step's peak rose above the process's earlier peaks.
    assert measured["activations"] > 2 * measured["earlier_peak"]
    predicted = estimate.activations + estimate.logits
    error = (predicted - measured["activations"]) / measured["activations"]
    print(f"{name} {tokens} tokens ckpt={checkpointing}: measured {measured['activations'] / 2**20:.0f} MiB, "
          f"predicted {predicted / 2**20:.0f} MiB ({error:+.1%})")
    assert abs(error) < MAX_ERROR


def test_recommendation_fits_and_scales():
    shape = ModelShape.from_hf_config(SHAPES["llama"])
    small = recommend_token_budget(shape, 2 * 2**30)
    large = recommend_token_budget(shape, 4 * 2**30)
    assert 0 < small.token_budget < large.token_budget
    assert small.estimate.total <= 2 * 2**30 * (1 - small.headroom)
    over = estimate_memory(shape, small.token_budget + 64)
    assert over.total > 2 * 2**30 * (1 - small.headroom)  # the largest multiple of 64 that fits
    ck = recommend_token_budget(ModelShape.from_hf_config(SHAPES["llama"], activation_checkpointing=True), 2 * 2**30)
    assert ck.token_budget > small.token_budget
    with pytest.raises(ValueError, match="weights, gradients and adamw state"):
        recommend_token_budget(shape, 100 * 2**20)
    with pytest.raises(ValueError, match="dtype"):
        ModelShape.from_hf_config(SHAPES["llama"], dtype="int8")


def test_memory_module_doctests():
    import doctest

    import evenflow.memory

    result = doctest.testmod(evenflow.memory)
    assert result.attempted > 0 and result.failed == 0
