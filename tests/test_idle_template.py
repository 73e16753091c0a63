"""Regression (found by the soak): an IDLE placeholder must never be an over-budget batch.

A rank that must emit an IDLE step before it buffered any sample within the budget (it only ever received
``oversize="alone"`` samples) used to collate ``dataset[0]`` as the placeholder -- over the budget when that
sample is. It now takes the first dataset sample within the budget, or fails naming ``idle_sample=``.
"""

from __future__ import annotations

import pytest
import torch

import evenflow


def _sample(n):
    return {"input_ids": torch.arange(n) % 7 + 1}


def test_placeholder_is_the_first_sample_within_the_budget():
    data = [_sample(600), _sample(700), _sample(12), _sample(30)]
    loader = evenflow.DynamicBatchLoader(data, token_budget=512, oversize="alone", shuffle=False)
    try:
        assert len(loader._idle.template()["input_ids"]) == 12
    finally:
        loader.close()


def test_no_sample_within_the_budget_is_a_clear_error_naming_idle_sample():
    loader = evenflow.DynamicBatchLoader([_sample(600), _sample(700)], token_budget=512, oversize="alone")
    try:
        with pytest.raises(RuntimeError, match=r"token_budget=512.*idle_sample="):
            loader._idle.template()
    finally:
        loader.close()
