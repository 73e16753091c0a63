"""Misuse cannot pass silently: a StepInfo never popped, a loss never scaled, a batch_size= argument.

NOTE [ Misuse is loud ] in evenflow.step_info.
"""

from __future__ import annotations

import copy

import pytest
import torch

import evenflow
from evenflow.step_info import StepInfoMisuse


class Tiny(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return {"input_ids": torch.arange(2 + i % 5)}


def _loader(**kw):
    return evenflow.DynamicBatchLoader(Tiny(), token_budget=8, shuffle=False, **kw)


def test_forgetting_pop_step_info_raises_with_the_fix():
    swallowed = []

    def model(**kwargs):  # an HF model's **kwargs swallow the step-info key
        swallowed.append(evenflow.STEP_INFO_KEY in kwargs)

    with pytest.raises(StepInfoMisuse, match=r"rank 0, epoch 0, step 0 .*pop_step_info\(batch\)"):
        for batch in _loader():
            model(**batch)
    assert swallowed and all(swallowed) and len(swallowed) == 3  # raised on the 3rd fetch after batch 0 (lag 2)


def test_copies_of_the_batch_dict_do_not_break_the_check():
    n = 0
    for batch in _loader():
        info = evenflow.pop_step_info({**batch})  # a copy: the StepInfo itself records it was taken
        copy.copy(batch)
        n += info.local_samples
    assert n == 24


def test_scaled_mode_requires_scale_loss():
    with pytest.raises(StepInfoMisuse, match="never passed to scale_loss"):
        for batch in _loader(usage_check="scaled"):
            evenflow.pop_step_info(batch)
    total = 0
    for batch in _loader(usage_check="scaled"):
        info = evenflow.pop_step_info(batch)
        total += float(evenflow.scale_loss(torch.tensor(1.0), info))
    assert total > 0


def test_check_waits_for_accumulation_windows():
    # HF fetches a whole window before running any of it: with grad_accum_steps=3 four fetches happen first.
    loader = _loader(grad_accum_steps=3)
    it = iter(loader)
    ahead = [next(it) for _ in range(4)]
    for b in ahead:
        evenflow.pop_step_info(b)
    for b in it:
        evenflow.pop_step_info(b)
    with pytest.raises(ValueError, match="usage_check"):
        _loader(usage_check="sometimes")


def test_usage_check_off():
    assert sum(1 for _ in _loader(usage_check="off")) > 3


@pytest.mark.parametrize("name", ["batch_size", "max_tokens"])
def test_fixed_batch_arguments_name_token_budget(name):
    with pytest.raises(TypeError, match=rf"'{name}'.*token_budget.*{name}= -> token_budget="):
        evenflow.DynamicBatchLoader(Tiny(), token_budget=8, **{name: 8})


def test_every_loader_argument_is_described_on_the_loader():
    import inspect

    doc = evenflow.DynamicBatchLoader.__doc__
    params = [p for p in inspect.signature(evenflow.DynamicBatchLoader.__init__).parameters.values()
              if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]
    assert len(params) >= 30
    missing = [p.name for p in params if f"``{p.name}``" not in doc]
    assert not missing, missing


def test_labels_free_dataset_trains_as_causal_lm():
    emb = torch.nn.Embedding(8, 8)
    for batch in evenflow.DynamicBatchLoader(Tiny(), token_budget=8):  # the README loop, no labels anywhere
        info = evenflow.pop_step_info(batch)
        labels = batch["labels"]
        assert int((labels[:, 1:] != -100).sum()) == info.local_loss_tokens
        assert torch.equal(labels[batch["attention_mask"] == 1], batch["input_ids"][batch["attention_mask"] == 1])
        logits = emb(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 8), labels[:, 1:].reshape(-1))
        evenflow.scale_loss(loss, info).backward()
    assert torch.isfinite(emb.weight.grad).all() and emb.weight.grad.abs().sum() > 0
