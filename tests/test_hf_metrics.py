"""Honest HF Trainer metrics under dynamic batches: epoch, progress total, samples/s, tokens/s, TensorBoard.

A single-process DynamicBatchTrainer on a tiny Llama (2 epochs of 30 samples, several samples per batch): the
logged ``epoch`` is samples done / N, ``state.max_steps`` (the progress bar total) is an upper bound that only
tightens and ends at the steps taken, ``train_samples_per_second`` counts the samples trained, an ignored
fixed-batch argument warns once at the caller, and the metrics reach a real TensorBoard event file.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
                                reason="needs the 'hf' extra: pip install 'evenflow[hf]'")

N = 30


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        ids = (torch.arange(3 + (i * 7) % 13) * (i + 1)) % 50
        return {"input_ids": ids}


def _model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, head_dim=8))


def _train(tmp_path, **extra):
    from transformers import TrainerCallback, TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer

    bounds = []

    class Bounds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            bounds.append((state.global_step, state.max_steps))

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, num_train_epochs=2, logging_steps=1,
                             gradient_accumulation_steps=2, learning_rate=1e-3, save_strategy="no",
                             lr_scheduler_type="constant", dataloader_pin_memory=False, **extra)
    trainer = DynamicBatchTrainer(model=_model(), args=args, train_dataset=Samples(), token_budget=64)
    trainer.add_callback(Bounds())
    trainer.train()
    return trainer, bounds


def test_epoch_progress_speed_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from evenflow.integrations.hf_epochs import BoundProgressCallback

    trainer, bounds = _train(tmp_path, report_to="tensorboard", disable_tqdm=False)
    assert any(isinstance(cb, BoundProgressCallback) for cb in trainer.callback_handler.callbacks)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    epochs = [log["epoch"] for log in logs]
    assert epochs == sorted(epochs) and epochs[-1] == 2.0
    # Fractions are samples done / N: strictly inside (0, 1) during epoch 0, never a jump from 0.1 to 1.0.
    first = [e for e in epochs if e < 1.0]
    assert first and all(0 < e < 1 for e in first)
    assert max(b - a for a, b in zip([0.0] + epochs, epochs)) < 0.75
    # The progress total: an upper bound at every step, never loosening, ending at the steps taken.
    assert all(total >= step for step, total in bounds)
    totals = [t for _, t in bounds]
    assert totals == sorted(totals, reverse=True)
    assert trainer.state.max_steps == trainer.state.global_step
    end = trainer.state.log_history[-1]
    assert end["train_samples"] == 2 * N
    assert end["train_samples_per_second"] == pytest.approx(2 * N / end["train_runtime"], rel=1e-2)
    assert end["train_tokens_per_second"] > end["train_samples_per_second"]
    (event_file,) = tmp_path.rglob("events.out.tfevents.*")  # HF writes under output_dir/runs/<date_host>
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("train/loss", "train/evenflow/imbalance", "train/evenflow/local_padded_efficiency", "train/epoch"):
        assert tag in tags, (tag, tags)
    assert len(events.Scalars("train/loss")) == len(logs)


def test_ignored_fixed_batch_argument_warns_once_at_the_call_site(tmp_path):
    from transformers import TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=4, report_to=[],
                             dataloader_drop_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DynamicBatchTrainer(model=_model(), args=args, train_dataset=Samples(), token_budget=64)
    ours = [w for w in caught if "DynamicBatchTrainer ignores" in str(w.message)]
    assert len(ours) == 1
    assert "per_device_train_batch_size=4" in str(ours[0].message) and "dataloader_drop_last=True" in str(ours[0].message)
    assert ours[0].filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DynamicBatchTrainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                   report_to=[]),
                            train_dataset=Samples(), token_budget=64)
    assert not [w for w in caught if "DynamicBatchTrainer ignores" in str(w.message)]
