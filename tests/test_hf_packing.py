"""Packing is exact with stock HF models: ``cost="summed"`` batches equal the per-sample reference.

Models are ``AutoModelForCausalLM.from_config`` on tiny default-shaped Qwen3 / Llama configs (``use_cache`` left
at the config default, True: evenflow alone must switch it off), called exactly as the README does
(``model(**batch)``), through the plain loop and through ``DynamicBatchTrainer``. References run every sample
alone. Tolerances: HF's own loss upcasts logits to float32, so it is compared at 1e-6; a float64 loss on float64
logits at 1e-10 with sdpa. HF's eager attention computes its softmax in float32 even for a float64 model
(``softmax(..., dtype=torch.float32)`` in every eager_attention_forward), so eager float64 logits carry float32
rounding whatever the batching: there the bound is 1e-6 relative (measured ~1e-7), not 1e-10.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import evenflow

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs the 'hf' extra: pip install 'evenflow[hf]'")

VOCAB = 97
LENGTHS = [5, 11, 3, 8, 13, 2, 7, 9, 4, 6]
BUDGET = 32


def _model(arch: str, attn: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    config = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)
    assert config.use_cache  # the default the leak came from; only evenflow may turn it off
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(dtype)
    model.train()
    return model


class Chats(torch.utils.data.Dataset):
    """Samples with a masked prompt (labels) or without labels at all (causal LM on input_ids)."""

    def __init__(self, with_labels: bool = True) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
        self.with_labels = with_labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        if not self.with_labels:
            return {"input_ids": ids}
        labels = ids.clone()
        labels[: len(ids) // 3] = -100
        return {"input_ids": ids, "labels": labels}


def _token_losses(model, sample: dict, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Sum of this sample's next-token losses (float64 from logits) and their count, the sample run alone."""
    ids = sample["input_ids"][None]
    labels = sample.get("labels", sample["input_ids"])[None]
    logits = model(input_ids=ids).logits.to(dtype)
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target.reshape(-1),
                                             reduction="sum", ignore_index=-100)
    return loss, int((target != -100).sum())


def _reference(model, dataset, ids) -> torch.Tensor:
    parts = [_token_losses(model, dataset[i], torch.float64) for i in ids]
    return sum(p[0] for p in parts) / sum(p[1] for p in parts)


def _packed_float64_loss(model, batch: dict) -> torch.Tensor:
    logits = model(**batch).logits.to(torch.float64)
    labels = batch["labels"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def _grads(model) -> torch.Tensor:
    out = torch.cat([p.grad.reshape(-1).to(torch.float64) for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


CASES = [(a, m) for a in ("qwen3", "llama") for m in ("sdpa", "eager")]


# Every architecture/attention pair with labels; the labels-free (causal LM) path once, on the README's model.
PLAIN_CASES = [(a, m, True) for a, m in CASES] + [("qwen3", "sdpa", False)]


@pytest.mark.parametrize("arch,attn,with_labels", PLAIN_CASES)
def test_plain_loop_packed_equals_per_sample(arch, attn, with_labels):
    dataset = Chats(with_labels)
    tol64 = 1e-10 if attn == "sdpa" else 1e-6
    for dtype in (torch.float32, torch.float64):
        model = _model(arch, attn, dtype)
        loader = evenflow.DynamicBatchLoader(dataset, token_budget=BUDGET, cost="summed", shuffle=False)
        seen = []
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            assert "attention_mask" not in batch and batch["use_cache"] is False
            assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_q"] == batch["max_length_k"]
            assert int((batch["labels"][:, 1:] != -100).sum()) == info.local_loss_tokens
            seen += info.sample_ids
            if dtype == torch.float32:
                hf_loss = evenflow.scale_loss(model(**batch).loss, info)  # README call path, HF's own loss
                ref = _reference(model, dataset, info.sample_ids)
                assert abs(hf_loss.item() - ref.item()) < 1e-6, (arch, attn, info.step)
                continue
            loss = _packed_float64_loss(model, batch)
            evenflow.scale_loss(loss, info).backward()
            got = _grads(model)
            ref = _reference(model, dataset, info.sample_ids)
            ref.backward()
            want = _grads(model)
            assert abs(loss.item() - ref.item()) <= tol64 * abs(ref.item()), (arch, attn, info.step)
            assert _rel(got, want) < tol64, (arch, attn, info.step)
        assert sorted(seen) == list(range(len(dataset)))


def test_without_evenflows_use_cache_the_leak_is_real():
    # Hostile control: the same packed batch without the use_cache entry lets sequences attend to each other
    # (HF's cache disables its packed detection), so the tests above can fail.
    model = _model("qwen3", "sdpa", torch.float64)
    dataset = Chats()
    batch = evenflow.FlatCollate()([dataset[i] for i in range(4)])
    ref = _reference(model, dataset, range(4))
    exact = _packed_float64_loss(model, batch)
    leaky = _packed_float64_loss(model, {k: v for k, v in batch.items() if k != "use_cache"})
    assert abs(exact.item() - ref.item()) < 1e-10
    assert abs(leaky.item() - ref.item()) > 1e-4


def test_flat_collate_refuses_use_cache_true():
    with pytest.raises(ValueError, match="attend to each other"):
        evenflow.FlatCollate(use_cache=True)
    batch = evenflow.FlatCollate(use_cache=None)([{"input_ids": torch.arange(3)}])
    assert "use_cache" not in batch


def _trainer(model, dataset, tmp_path, collator=None):
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, learning_rate=0.0)
    return DynamicBatchTrainer(model=model, args=args, train_dataset=dataset, token_budget=BUDGET, cost="summed",
                               shuffle=False, data_collator=collator)


@pytest.mark.parametrize("arch,attn", CASES)
def test_trainer_packed_equals_per_sample(arch, attn, tmp_path):
    dataset = Chats()
    model = _model(arch, attn, torch.float32)
    trainer = _trainer(model, dataset, tmp_path)
    batches = trainer.get_train_dataloader()
    try:
        for batch in batches:
            info = batch[evenflow.STEP_INFO_KEY]
            loss = trainer.compute_loss(model, batch)
            loss.backward()
            got = _grads(model)
            ref = _reference(model, dataset, info.sample_ids)
            ref.backward()
            want = _grads(model)
            assert abs(loss.item() - ref.item()) < 1e-6, (arch, attn, info.step)
            assert _rel(got, want) < 1e-5, (arch, attn, info.step)  # float32 model: float32 gradients
    finally:
        trainer.close_train_loader()


def test_trainer_switches_cache_off_for_a_user_packing_collator(tmp_path):
    # A user collator that packs but knows nothing of use_cache (HF's DataCollatorWithFlattening): the trainer
    # passes use_cache=False itself.
    from transformers import DataCollatorWithFlattening

    dataset = Chats()
    model = _model("qwen3", "sdpa", torch.float32)
    trainer = _trainer(model, dataset, tmp_path, collator=DataCollatorWithFlattening(return_tensors="pt"))
    batches = trainer.get_train_dataloader()
    try:
        batch = next(iter(batches))
        assert "use_cache" not in batch
        info = batch[evenflow.STEP_INFO_KEY]
        loss = trainer.compute_loss(model, batch)
        assert abs(loss.item() - _reference(model, dataset, info.sample_ids).item()) < 1e-6
    finally:
        trainer.close_train_loader()


def test_the_docs_packing_snippet_as_written_equals_the_per_sample_reference():
    """docs/quickstart/hf-trainer.md's loop, exec'd as written (its ``from_config`` returns this test's model):
    one epoch of packed steps, gradients equal to the per-sample reference."""
    from _snippets import snippet

    model = _model("qwen3", "sdpa", torch.float32)

    class AutoModelForCausalLM:
        from_config = staticmethod(lambda config: model)

    dataset = Chats()
    exec(snippet("hf-packing"), {"AutoModelForCausalLM": AutoModelForCausalLM, "config": model.config,  # noqa: S102
                                 "dataset": dataset, "evenflow": evenflow})
    assert model.config.use_cache is True  # untouched: the batch itself switched the cache off
    got = _grads(model)
    assert sum(LENGTHS) <= 16384  # the snippet's budget: the whole epoch is one packed step
    _reference(model, dataset, range(len(dataset))).backward()
    assert _rel(got, _grads(model)) < 1e-5
