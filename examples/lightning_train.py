"""Lightning with evenflow batches: ``DynamicBatchDataModule`` + ``EvenflowModule`` + ``EvenflowCallback`` +
``EvenflowProgressBar`` + ``training_loss``.

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py
    python examples/lightning_train.py          # Lightning launches the 2 processes itself

``use_distributed_sampler=False``: evenflow shards and aligns the data itself. Lightning divides the returned
loss by ``accumulate_grad_batches``; ``training_loss`` undoes that, because ``loss_scale`` already normalizes the
accumulation window. ``EvenflowModule`` (instead of ``L.LightningModule``) drops ``self.log`` calls made in
``training_step`` on IDLE batches, so ``train_loss`` is the loss of real batches only. ``EvenflowProgressBar``
shows the loader's step bound as the epoch's total (``Epoch 0: 3/34``, tightening to the exact count), so the bar
has an ETA although the train loader has no ``len()``. Validation uses evenflow eval batches; the token-weighted
``MeanMetric`` gives the exact per-token loss across ranks (IDLE batches weigh 0).
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torchmetrics

import evenflow
from evenflow.integrations.lightning import (DynamicBatchDataModule, EvenflowCallback, EvenflowModule,
                                            EvenflowProgressBar, training_loss)
from _tiny import RandomChat, tiny_llama


class TinyModule(EvenflowModule):
    def __init__(self, lr: float = 3e-3, dtype=torch.float32) -> None:
        super().__init__()
        self.model = tiny_llama(dtype=dtype)
        self.lr = lr
        self.val_loss = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        info = evenflow.pop_step_info(batch)
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)  # per rank; IDLE batches are not logged
        return training_loss(loss, info, self.trainer)

    def validation_step(self, batch, batch_idx):
        info = evenflow.pop_step_info(batch)
        loss = self.model(**batch).loss
        if info.local_loss_tokens:  # IDLE batches (and batches without supervised tokens) weigh 0
            self.val_loss.update(loss, weight=info.local_loss_tokens)
        self.log("val_loss", self.val_loss, on_epoch=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit(*, module: L.LightningModule | None = None, epochs: int = 2, accum: int = 2, token_budget: int = 256,
        n: int = 256, callbacks: tuple = (), ckpt_path: str | None = None, root: str = "lightning_out",
        max_steps: int = -1, progress_bar: bool = True, devices: int = 2,
        lr_scaling: str | None = None) -> L.Trainer:
    datamodule = DynamicBatchDataModule(RandomChat(n), token_budget=token_budget, val_dataset=RandomChat(64, seed=1),
                                        buffer_size=64)
    trainer = L.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=devices, strategy="ddp",
                        max_epochs=epochs, max_steps=max_steps, accumulate_grad_batches=accum,
                        use_distributed_sampler=False,
                        callbacks=[EvenflowCallback(lr_scaling=lr_scaling),
                                   *([EvenflowProgressBar()] if progress_bar else []), *callbacks],
                        default_root_dir=root, log_every_n_steps=5, enable_progress_bar=progress_bar,
                        enable_model_summary=False)
    trainer.fit(module or TinyModule(), datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", default=None, help="a Lightning checkpoint (.ckpt)")
    cli = parser.parse_args()
    trainer = fit(epochs=cli.epochs, ckpt_path=cli.resume)
    if trainer.is_global_zero:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        print("done:", trainer.global_step, "optimizer steps;", metrics)


if __name__ == "__main__":
    main()
