"""The epoch's exact step count before it starts (NOTE [ The planned epoch length ] in evenflow.runtime.epoch_plan).

With ``lengths=``, ``len(loader)`` is each epoch's exact batch count before and during it (at fbdadc2: the bound
``ceil(N / W)``, 4x the real count here, tightening in blocks of ``max_steps_per_round``); wrong lengths are
refused on every rank; HF's ``Trainer`` gets the exact optimizer steps before step 0 -- its ``state.max_steps``,
its progress bar and its LR schedule's horizon -- from an HF dataset's own ``input_ids`` lengths. Real gloo ranks.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import evenflow
from _dist import RankFailed, run_world
from evenflow.runtime.epoch_plan import dataset_lengths

N = 400


def _lengths(n: int = N) -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.clip(rng.lognormal(5.0, 1.0, n).astype(np.int64), 4, 1024)


class _Ids(Dataset):
    def __init__(self, lengths, lie_at: int | None = None) -> None:
        self.lengths, self.lie_at = lengths, lie_at

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i]) + (3 if i == self.lie_at else 0)
        return {"input_ids": torch.full((n,), i)}


def _epochs(rank, world, planning, shuffle):
    lengths = _lengths()
    loader = evenflow.DynamicBatchLoader(_Ids(lengths), token_budget=1024, planning=planning, shuffle=shuffle,
                                         buffer_size=64, lengths=lengths, timeout=timedelta(seconds=60))
    out = []
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            before, during, steps = len(loader), set(), 0
            for batch in loader:
                evenflow.pop_step_info(batch)
                during.add(len(loader))
                steps += 1
            out.append((before, sorted(during), steps))
    finally:
        loader.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("planning,world,shuffle", [("local", 2, True), ("global", 3, True), ("global", 2, False)])
def test_len_is_the_exact_step_count_before_and_during_every_epoch(planning, world, shuffle):
    results = run_world(_epochs, world, planning, shuffle, timeout=240)
    for rank_epochs in results:
        assert rank_epochs == results[0]  # identical on every rank
        for before, during, steps in rank_epochs:
            assert before == steps and during == [steps], (before, during, steps)
            assert steps < -(-N // world) / 2  # the bound it replaces is far off


def _lie(rank, world):
    lengths = _lengths()
    loader = evenflow.DynamicBatchLoader(_Ids(lengths, lie_at=int(np.argsort(lengths)[N // 2])), token_budget=1024,
                                         buffer_size=64, lengths=lengths, timeout=timedelta(seconds=60))
    try:
        for batch in loader:
            evenflow.pop_step_info(batch)
    finally:
        loader.close()


@pytest.mark.multiprocess
def test_wrong_lengths_are_refused_on_every_rank():
    results = run_world(_lie, 2, timeout=240, allow_errors=True)
    assert all(isinstance(r, RankFailed) for r in results), results
    assert any("lengths= gives them" in r.text and "measured" in r.text for r in results)
    assert all("lengths= gives them" in r.text for r in results), [r.text[-600:] for r in results]


def test_unplannable_configurations_say_why():
    lengths = _lengths(20)
    with pytest.raises(ValueError, match="quota mode"):
        evenflow.DynamicBatchLoader(_Ids(lengths), token_budget=1024, join=False, lengths=lengths)
    with pytest.raises(ValueError, match="has 19 entries for a dataset of 20"):
        evenflow.DynamicBatchLoader(_Ids(lengths), token_budget=1024, lengths=lengths[:19])
    with pytest.raises(ValueError, match="'num_patches'"):
        evenflow.DynamicBatchLoader(_Ids(lengths), token_budget=1024, extra_budgets={"num_patches": 8},
                                    lengths=lengths)


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")
def test_dataset_lengths_read_arrow_offsets_or_one_pass():
    from datasets import Dataset as HFDataset

    rows = [{"input_ids": list(range(int(n)))} for n in _lengths(50)]
    hf = HFDataset.from_list(rows).shuffle(seed=0)
    expected = [len(hf[i]["input_ids"]) for i in range(len(hf))]
    assert dataset_lengths(hf).tolist() == expected
    assert dataset_lengths(_Ids(_lengths(50))).tolist() == _lengths(50).tolist()


def _hf_run(rank, world, out_dir):
    from datasets import Dataset as HFDataset
    from transformers import TrainerCallback, TrainingArguments

    from evenflow.integrations.hf import DynamicBatchTrainer
    from integration_scenarios import VOCAB, tiny_llama, torchrun_env

    torchrun_env(rank, world)
    rows = [{"input_ids": [1 + (i + t) % (VOCAB - 1) for t in range(int(n))]}
            for i, n in enumerate(_lengths(240) // 20 + 2)]
    seen = {}

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["max_steps_at_start"] = state.max_steps

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            seen.setdefault("lrs", []).append(kwargs["lr_scheduler"].get_last_lr()[0])

    args = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to="none", num_train_epochs=2,
                             gradient_accumulation_steps=3, learning_rate=1e-3, lr_scheduler_type="linear",
                             save_strategy="no", disable_tqdm=True, logging_steps=1, dataloader_pin_memory=False)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = DynamicBatchTrainer(model=tiny_llama(), args=args, train_dataset=HFDataset.from_list(rows),
                                      token_budget=128, callbacks=[Watch()])
        trainer.train()
    seen["warned_bound"] = any("upper bound" in str(w.message) for w in caught)
    seen["global_step"] = trainer.state.global_step
    return seen


@pytest.mark.multiprocess
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "datasets")),
                    reason="needs the 'hf' extra")
def test_hf_trainer_knows_the_exact_optimizer_steps_before_step_0(tmp_path):
    """At fbdadc2: state.max_steps at train begin was the bound, the linear schedule never reached 0, and HF
    warned to set max_steps."""
    results = run_world(_hf_run, 2, str(tmp_path), timeout=300)
    for seen in results:
        assert seen["max_steps_at_start"] == seen["global_step"] == len(seen["lrs"])
        assert seen["lrs"][-1] == 0.0 and seen["lrs"][-2] > 0.0  # the linear schedule ends exactly at the end
        assert not seen["warned_bound"]


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs the 'lightning' extra")
def test_lightning_schedule_sized_by_the_planned_optimizer_steps(tmp_path):
    """The datamodule's planned optimizer steps equal the steps Lightning takes (2 epochs, accumulation 3), and
    a OneCycle schedule sized by them ends exactly at the last step (it raises if stepped past its total)."""
    import lightning as L

    from evenflow.integrations.lightning import DynamicBatchDataModule, EvenflowModule, training_loss

    lengths = _lengths(90) // 8 + 2

    class Module(EvenflowModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(N, 8)

        def training_step(self, batch, batch_idx):
            info = evenflow.pop_step_info(batch)
            loss = self.emb(batch["input_ids"]).pow(2).mean()
            return training_loss(loss, info, self.trainer)

        def configure_optimizers(self):
            self.total = self.trainer.datamodule.planned_optimizer_steps(self.trainer.max_epochs)
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.total)
            return [opt], [{"scheduler": sched, "interval": "step"}]

    dm = DynamicBatchDataModule(_Ids(lengths), token_budget=160, buffer_size=16, lengths=lengths)
    module = Module()
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=3, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    assert module.total == trainer.global_step > 0
