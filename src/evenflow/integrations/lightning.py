"""Lightning: [`DynamicBatchDataModule`][DynamicBatchDataModule] (+ [`EvenflowModule`][EvenflowModule],
[`EvenflowCallback`][EvenflowCallback], [`EvenflowProgressBar`][EvenflowProgressBar],
[`training_loss()`][training_loss]).

    dm = DynamicBatchDataModule(train_set, token_budget=8192, val_dataset=val_set)
    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="ddp", accumulate_grad_batches=4,
                        use_distributed_sampler=False, callbacks=[EvenflowCallback(), EvenflowProgressBar()])
    trainer.fit(module, datamodule=dm)

    class Module(EvenflowModule):          # instead of L.LightningModule: IDLE batches are never logged
        def training_step(self, batch, batch_idx):
            info = pop_step_info(batch)
            loss = self.model(**batch).loss
            self.log("train_loss", loss)    # skipped on this rank's IDLE batches
            return training_loss(loss, info, self.trainer)

Written against lightning 2.6. How each Lightning mechanism is kept exact:

- Accumulation: the loader's ``grad_accum_steps`` is ``trainer.accumulate_grad_batches``. Lightning steps the
  optimizer every ``accumulate_grad_batches`` batches *and* on an epoch's last batch, which is exactly where
  evenflow's windows end. Lightning divides the returned loss by ``accumulate_grad_batches``; evenflow's
  ``loss_scale`` already normalizes the whole window, so [`training_loss()`][training_loss] multiplies that division
  back.
- Epochs: one ``iter()`` of the train loader is one evenflow epoch; the loader (not Lightning's sampler hook,
  which only reaches ``torch`` samplers) owns the epoch number. The train loader has no ``len()``: Lightning
  then ends the epoch when the loader is exhausted and validates there (given a length -- evenflow's is only an
  upper bound -- it would wait for a batch count that never comes and skip end-of-epoch validation). So
  ``trainer.estimated_stepping_batches`` is infinite under ``max_epochs``: size LR schedules with
  [`DynamicBatchDataModule.planned_optimizer_steps()`][DynamicBatchDataModule.planned_optimizer_steps] (exact, given the
  ``lengths=`` loader option) or ``max_steps``.
- Progress and ETA: the bound goes to the progress bar instead. [`EvenflowProgressBar`][EvenflowProgressBar] (a
  ``TQDMProgressBar``) sets its train total to each batch's ``StepInfo.steps_bound`` -- the loader's ``len()``
  as known at that step, identical on every rank, tightening as the epoch runs -- and to the exact count at the
  epoch's end. An ``IterableDataset`` has no bound before its end, so its bar honestly shows no total.
- IDLE batches: a rank that ran dry trains real-shaped placeholders with ``loss_scale == 0`` (DDP needs their
  backward). Their loss is a real-looking number, so a reflexive ``self.log("train_loss", loss)`` would log it.
  [`EvenflowModule`][EvenflowModule] drops ``self.log`` / ``self.log_dict`` calls made inside ``training_step`` on such
  a batch (NOTE [ IDLE batches are not logged ]); ``on_epoch`` means then average real batches only (at an IDLE
  step Lightning's loggers repeat the last real value, never the placeholder's).
- Resume: the train loader implements ``state_dict``/``load_state_dict``, which Lightning saves in the fit loop
  state. Lightning writes checkpoints from rank 0 only, so the state gathers every rank's position (collective;
  Lightning builds checkpoints on all ranks); resuming on another number of devices re-deals the untrained
  rest of the epoch. Lightning fetches one batch ahead, so the loader has already
  handed out batch ``b + 1`` when batch ``b`` is checkpointed: the state excludes every window that ends after
  the batch being trained (reported by the DataModule's ``on_before_batch_transfer`` hook).
- Batch transfer: Lightning's ``apply_to_collection`` refuses frozen dataclasses, so the DataModule's
  ``on_before_batch_transfer`` / ``on_after_batch_transfer`` take [`StepInfo`][StepInfo] out of the batch around the
  device move. A LightningModule that overrides these two hooks replaces the DataModule's: call
  ``datamodule.on_before_batch_transfer`` / ``on_after_batch_transfer`` from yours.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

import torch

try:
    import lightning as L
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("evenflow.integrations.lightning needs lightning: pip install 'evenflow[lightning]'") from exc

from ..lr import TokenLRRule, TokenLRScaler
from ..runtime.loader import DynamicBatchLoader
from .states import gather_states, resume_epoch
from ..step_info import STEP_INFO_KEY, StepInfo, scale_loss
from .evaluation import eval_loader
from .lightning_logs import EvenflowModule, EvenflowProgressBar
from .metrics import StepMetrics

__all__ = ["DynamicBatchDataModule", "EvenflowCallback", "EvenflowModule", "EvenflowProgressBar", "training_loss"]

_STATE_VERSION = 1
# Windows remembered for excluding handed-out-but-untrained ones (Lightning prefetches one batch).
_RECENT_WINDOWS = 8


def training_loss(loss: torch.Tensor, info: StepInfo, trainer) -> torch.Tensor:
    """The loss to return from ``training_step``: ``loss * loss_scale * accumulate_grad_batches``.

    ``loss`` is the mean over this batch's supervised tokens. Lightning divides what ``training_step`` returns
    by ``accumulate_grad_batches`` (also for an epoch's shorter last window); evenflow's ``loss_scale`` already
    normalizes over the window, so that division is undone here. IDLE batches give exactly 0. With manual
    optimization (``automatic_optimization = False``) Lightning divides nothing: use ``scale_loss`` directly and
    step the optimizer on ``info.window_end``.
    """
    return scale_loss(loss, info) * trainer.accumulate_grad_batches


class _Batches:
    """Evaluation batches: one full pass per ``iter()``; ``len()`` is an upper bound (map-style datasets only)."""

    def __init__(self, loader: DynamicBatchLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        if not hasattr(self.loader.dataset, "__len__"):
            raise TypeError("an IterableDataset's epoch length is unknown")
        return -(-len(self.loader.dataset) // self.loader.world_size)  # join mode: steps <= largest shard

    def __iter__(self):
        return iter(self.loader)


class _TrainBatches:
    """Train batches with a gathered, trained-position-exact state (see the module docstring). No ``len()``."""

    def __init__(self, loader: DynamicBatchLoader) -> None:
        self.loader = loader
        self.epoch = 0
        self._windows: deque = deque(maxlen=_RECENT_WINDOWS)  # (end step, keys) of handed-out windows
        self._pending: list = []                              # keys of the window being handed out
        self._current = -1                                    # step of the batch being trained
        self._last_step = -1

    def __iter__(self):
        epoch = self.epoch
        self.loader.set_epoch(epoch)
        self._windows.clear()
        self._pending, self._current, self._last_step = [], -1, -1
        for batch in self.loader:
            info: StepInfo = batch[STEP_INFO_KEY]
            self._pending.extend(info.sample_ids)
            if info.window_end:
                self._windows.append((info.step, self._pending))
                self._pending = []
            self._last_step = info.step
            yield batch
        self.epoch = epoch + 1

    def mark_current(self, batch: object) -> None:
        if isinstance(batch, Mapping) and STEP_INFO_KEY in batch:
            self._current = batch[STEP_INFO_KEY].step

    def _trained_state(self) -> dict:
        state = self.loader.state_dict()
        if state["finished"] or state["epoch"] != self.epoch:
            return state  # the whole epoch was handed out *and* trained (Lightning saw its end)
        ahead = {k for end, keys in self._windows if end > self._current for k in keys}
        if ahead:
            state = {**state, "consumed": [k for k in state["consumed"] if k not in ahead]}
        return state

    def state_dict(self) -> dict:
        # NOTE [ Gather states on the default group ] (evenflow.integrations.states)
        return {"version": _STATE_VERSION, "ranks": gather_states(self._trained_state())}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError("evenflow loader state: wrong version (saved by an incompatible evenflow release)")
        states = list(state["ranks"])
        self.loader.load_state_dict(states)  # another number of ranks: the rest of the epoch is re-dealt
        self.epoch = resume_epoch(states)


class DynamicBatchDataModule(L.LightningDataModule):
    """Train (and optionally validation) loaders with evenflow batching.

    ``token_budget`` and other [`DynamicBatchLoader`][DynamicBatchLoader] options are keyword arguments;
    ``grad_accum_steps`` comes from ``Trainer(accumulate_grad_batches=...)``. Validation uses
    [`eval_loader()`][eval_loader] (no shuffle, every sample once; IDLE batches have ``loss_scale == 0`` -- weight
    validation losses by ``StepInfo.local_loss_tokens``, e.g. ``torchmetrics.MeanMetric().update(loss, weight=...)``).
    Loaders are built in ``setup`` (collective: Lightning calls it on every rank). Use
    ``use_distributed_sampler=False``.
    """

    def __init__(self, train_dataset=None, *, token_budget: int, val_dataset=None, val_token_budget: int | None = None,
                 **loader_options) -> None:
        super().__init__()
        if "grad_accum_steps" in loader_options:
            raise TypeError("grad_accum_steps comes from Trainer(accumulate_grad_batches=...); do not pass it")
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.token_budget = token_budget
        self.val_token_budget = val_token_budget or token_budget
        self.loader_options = loader_options
        self.train_batches: _TrainBatches | None = None
        self.val_batches: _Batches | None = None
        self._in_transfer: StepInfo | None = None

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.train_batches is None and self.train_dataset is not None:
            accum = self.trainer.accumulate_grad_batches if self.trainer is not None else 1
            self.train_batches = _TrainBatches(DynamicBatchLoader(
                self.train_dataset, token_budget=self.token_budget, grad_accum_steps=accum, **self.loader_options))
        if stage in ("fit", "validate") and self.val_batches is None and self.val_dataset is not None:
            options = {k: v for k, v in self.loader_options.items() if k not in ("shuffle", "seed")}
            self.val_batches = _Batches(eval_loader(self.val_dataset, token_budget=self.val_token_budget, **options))

    def planned_optimizer_steps(self, max_epochs: int) -> int | None:
        """Optimizer steps of ``max_epochs`` epochs, planned from the ``lengths=`` loader option before training
        (NOTE [ The planned epoch length ] in evenflow.runtime.epoch_plan); None without it. Lightning steps at
        every ``accumulate_grad_batches`` batches and at each epoch's end: ``sum(ceil(batches / accum))``. Size LR
        schedules with it in ``configure_optimizers`` (the datamodule is set up by then):
        ``total = self.trainer.datamodule.planned_optimizer_steps(self.trainer.max_epochs)`` --
        ``trainer.estimated_stepping_batches`` cannot know it (the train loader has no ``len()``, see above)."""
        if self.train_batches is None:
            raise RuntimeError("planned_optimizer_steps needs the datamodule set up (Lightning does it before "
                               "configure_optimizers); call setup('fit') first when outside a Trainer")
        loader = self.train_batches.loader
        counts = [loader.fresh_planned_steps(e) for e in range(max_epochs)]
        accum = loader.config.grad_accum_steps
        return None if None in counts else sum(-(-c // accum) for c in counts)

    def train_dataloader(self):
        return self.train_batches

    def val_dataloader(self):
        return self.val_batches if self.val_batches is not None else []

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Lightning's batch transfer rebuilds dataclasses field by field and refuses frozen ones such as
        # StepInfo: carry it around the transfer and put it back afterwards.
        if self.trainer is not None and self.trainer.training and self.train_batches is not None:
            self.train_batches.mark_current(batch)
        if isinstance(batch, dict) and STEP_INFO_KEY in batch:
            self._in_transfer = batch.pop(STEP_INFO_KEY)
        return batch

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        info, self._in_transfer = self._in_transfer, None
        if info is not None:
            batch[STEP_INFO_KEY] = info
        return batch

    def teardown(self, stage: str) -> None:
        for batches in (self.train_batches, self.val_batches):
            if batches is not None:
                batches.loader.close()


class EvenflowCallback(L.Callback):
    """Per-step evenflow metrics (``evenflow/imbalance``, ``evenflow/local_padded_efficiency``, IDLE steps...),
    written to the trainer's own loggers every ``log_every_n_steps`` optimizer steps.

    Reads each batch's [`StepInfo`][StepInfo] in ``on_train_batch_start`` (before ``training_step`` pops it).

    ``lr_scaling="sqrt"`` / ``"linear"`` (or a [`evenflow.TokenLRRule`][evenflow.TokenLRRule]) also scales every
    optimizer step's LR by its window's global supervised tokens (evenflow.lr), relative to ``reference_tokens`` -- by
    default the DataModule's ``token_budget x trainer.world_size x accumulate_grad_batches``. LR schedulers keep
    stepping the unscaled LR. The scalers (one per optimizer) are ``callback.lr_scalers``; their references are saved in
    the checkpoint and kept on resume, also on another number of devices.
    """

    def __init__(self, *, lr_scaling: TokenLRRule | str | None = None) -> None:
        self.metrics = StepMetrics()
        self._info: StepInfo | None = None
        self.history: list[dict] = []
        """Every logged summary (also on ranks that do not write to a logger)."""
        self.lr_rule = TokenLRRule.coerce(lr_scaling)
        self.lr_scalers: list[TokenLRScaler] = []
        self._saved_lr: list[dict] = []  # from a checkpoint: the references the run was saved with

    def state_dict(self) -> dict:
        """Saved in Lightning checkpoints: each scaler's reference, kept when the run resumes on another number of
        devices (the default reference would follow the new world size)."""
        return {"lr_scalers": [scaler.state_dict() for scaler in self.lr_scalers]}

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved_lr = list(state_dict.get("lr_scalers", []))

    def on_train_start(self, trainer, pl_module) -> None:
        self.metrics = StepMetrics()
        if self.lr_rule is not None:
            self._attach_lr_rule(trainer)

    def _attach_lr_rule(self, trainer) -> None:
        budget = getattr(trainer.datamodule, "token_budget", None)
        if self.lr_rule.reference_tokens is None and not isinstance(budget, int):
            raise ValueError("EvenflowCallback(lr_scaling=...) needs the token budget for its default reference: "
                             "train with a DynamicBatchDataModule, or pass TokenLRRule(reference_tokens=...)")
        reference = self.lr_rule.resolve(token_budget=budget or 1, world_size=trainer.world_size,
                                         grad_accum_steps=trainer.accumulate_grad_batches)
        self._remove_lr_rule()
        self.lr_scalers = [TokenLRScaler(opt, scaling=self.lr_rule.scaling, reference_tokens=reference)
                           for opt in trainer.optimizers]
        if self._saved_lr and len(self._saved_lr) == len(self.lr_scalers):
            for scaler, saved in zip(self.lr_scalers, self._saved_lr):
                scaler.load_state_dict(saved)

    def _remove_lr_rule(self) -> None:
        for scaler in self.lr_scalers:
            scaler.remove()
        self.lr_scalers = []

    def on_train_end(self, trainer, pl_module) -> None:
        self._remove_lr_rule()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        info = batch.get(STEP_INFO_KEY) if isinstance(batch, Mapping) else None
        self._info = info
        if info is not None:
            self.metrics.update(info)
            for scaler in self.lr_scalers:  # every micro-batch of a window carries the window's total
                scaler.observe(info.window_loss_tokens)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        info, self._info = self._info, None
        if info is None or not info.window_end or trainer.global_step % trainer.log_every_n_steps:
            return
        summary = self.metrics.summary()
        if summary:
            self.history.append({**summary, "step": trainer.global_step, "time": time.time()})
            for logger in trainer.loggers:
                logger.log_metrics(summary, step=trainer.global_step)
