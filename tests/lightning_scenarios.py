"""Scenarios for tests/test_lightning.py, run inside a real 2-rank gloo world (tests/_dist.py) with ``L.Trainer.fit``.

Module-level so spawn-started ranks can import them. Each returns plain data: what the progress bar showed at every
batch, which batches were IDLE and what ``training_step`` logged for them, and what Lightning's loggers wrote.
"""

from __future__ import annotations

import csv
import math
import os
import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset

from integration_scenarios import _examples, torchrun_env

# Samples per rank of the iterable streams: rank 0 runs dry after 4 and trains IDLE batches until rank 1 is done;
# in the second, rank 0 has no sample at all (every one of its batches is IDLE).
STREAM_SAMPLES = {"uneven": (4, 14), "empty": (0, 6)}


def chat_sample(rank: int, i: int) -> dict:
    rng = np.random.default_rng([rank, i])
    n = int(rng.integers(6, 30))
    ids = torch.from_numpy(rng.integers(1, 64, n))
    labels = ids.clone()
    labels[: n // 3] = -100
    return {"input_ids": ids, "labels": labels}


class UnevenStream(IterableDataset):
    """This rank's own stream (no torch.distributed inside): ``counts[rank]`` chat-like samples."""

    def __init__(self, rank: int, counts: tuple) -> None:
        self.rank = rank
        self.counts = counts

    def __iter__(self):
        for i in range(self.counts[self.rank]):
            yield chat_sample(self.rank, i)


def _classes():
    import lightning as L

    from evenflow import STEP_INFO_KEY
    from evenflow.integrations.lightning import EvenflowProgressBar

    class RecordingBar(EvenflowProgressBar):
        """Records the bar's train total after each of its own hooks ran."""

        def __init__(self) -> None:
            super().__init__()
            self.batches, self.epoch_ends, self._info = [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._info = batch[STEP_INFO_KEY]
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            info = self._info
            bar = self.train_progress_bar
            self.batches.append(dict(epoch=trainer.current_epoch, batch_idx=batch_idx, total=bar.total, n=bar.n,
                                     steps_bound=info.steps_bound, step=info.step, idle=info.is_idle))

        def on_train_epoch_end(self, trainer, pl_module):
            super().on_train_epoch_end(trainer, pl_module)
            self.epoch_ends.append(dict(epoch=trainer.current_epoch, total=self.train_progress_bar.total,
                                        n=self.train_progress_bar.n))

    class ValRecorder(L.Callback):
        """When validation ran, relative to the train batches of its epoch."""

        def __init__(self, bar) -> None:
            self.bar = bar
            self.runs = []

        def on_validation_epoch_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                trained = sum(1 for b in self.bar.batches if b["epoch"] == trainer.current_epoch)
                self.runs.append(dict(epoch=trainer.current_epoch, trained=trained))

    return RecordingBar, ValRecorder


def _trainer(root: str, callbacks: list, *, epochs: int, accum: int, logger=False):
    import lightning as L
    return L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, accumulate_grad_batches=accum,
                     use_distributed_sampler=False, callbacks=callbacks, default_root_dir=root, logger=logger,
                     log_every_n_steps=1, enable_progress_bar=True, enable_model_summary=False,
                     enable_checkpointing=False)


def sc_progress_bar(rank, world, out_dir, n=96, accum=2):
    """Map-style data with validation: the bar's total at every batch, and when validation ran."""
    _examples()
    import lightning_train
    from _tiny import RandomChat

    from evenflow.integrations.lightning import DynamicBatchDataModule
    RecordingBar, ValRecorder = _classes()
    bar = RecordingBar()
    val = ValRecorder(bar)
    dm = DynamicBatchDataModule(RandomChat(n), token_budget=192, val_dataset=RandomChat(40, seed=1), buffer_size=16)
    trainer = _trainer(os.path.join(out_dir, "bar"), [bar, val], epochs=2, accum=accum)
    trainer.fit(lightning_train.TinyModule(lr=0.0), datamodule=dm)
    return dict(batches=bar.batches, epoch_ends=bar.epoch_ends, val_runs=val.runs,
                num_training_batches=float(trainer.num_training_batches),
                train_loader_has_len=hasattr(trainer.train_dataloader, "__len__"))


def _idle_module(base_name: str):
    import lightning as L

    import evenflow
    from evenflow.integrations.lightning import EvenflowModule, training_loss
    _examples()
    from _tiny import tiny_llama
    base = EvenflowModule if base_name == "evenflow" else L.LightningModule

    class Reflexive(base):
        """Logs the model loss of every batch it is given, as a user would: IDLE placeholders included."""

        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_llama(dtype=torch.float64)
            self.seen = []

        def training_step(self, batch, batch_idx):
            info = evenflow.pop_step_info(batch)
            loss = self.model(**batch).loss
            self.seen.append(dict(step=info.step, idle=info.is_idle, value=float(loss.detach()),
                                  rows=int(batch["input_ids"].shape[0])))
            self.log("train_loss", loss, on_step=True, on_epoch=True)
            self.log_dict({"train_loss_dict": loss}, on_step=True, on_epoch=False)
            self.log("synced_loss", evenflow.scale_loss(loss.detach(), info), sync_dist=True)
            self.log("epoch_synced", loss, on_step=False, on_epoch=True, sync_dist=True)
            return training_loss(loss, info, self.trainer)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Reflexive


def sc_idle_logging(rank, world, out_dir, base_name, streams="uneven"):
    """Uneven iterable streams (rank 0 goes IDLE), a training_step that logs reflexively, a CSVLogger."""
    from lightning.pytorch.loggers import CSVLogger

    from evenflow.integrations.lightning import DynamicBatchDataModule
    RecordingBar, _ = _classes()
    root = os.path.join(out_dir, f"idle_{base_name}_{streams}")
    bar = RecordingBar()
    module = _idle_module(base_name)()
    # planning="local": each rank batches its own stream, so rank 0 runs dry (global planning would share work).
    dm = DynamicBatchDataModule(UnevenStream(rank, STREAM_SAMPLES[streams]), token_budget=64, max_samples=2,
                                buffer_size=4, planning="local", idle_sample=chat_sample(9, 0))
    trainer = _trainer(root, [bar], epochs=1, accum=1, logger=CSVLogger(root, name="csv", version=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=dm)
    rows = []
    path = os.path.join(root, "csv", "version_0", "metrics.csv")
    if rank == 0:
        with open(path) as f:
            rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
    ours = [str(w.message) for w in caught if str(w.message).startswith("evenflow: self.log(")]
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return dict(seen=module.seen, csv=rows, warnings=ours, callback_metrics=metrics, batches=bar.batches,
                epoch_ends=bar.epoch_ends, finite=all(math.isfinite(v) for v in metrics.values()))


def world_body(rank, world, out_dir):
    import traceback
    torchrun_env(rank, world)
    torch.set_num_threads(1)
    out = {}
    cases = [("bar", sc_progress_bar, ()), ("idle", sc_idle_logging, ("evenflow",)),
             ("idle_plain", sc_idle_logging, ("plain",)), ("idle_empty", sc_idle_logging, ("evenflow", "empty"))]
    for name, fn, args in cases:
        try:
            out[name] = fn(rank, world, out_dir, *args)
        except Exception:  # noqa: BLE001 - report per scenario; the others still run
            out[name] = {"error": traceback.format_exc()}
    return out
