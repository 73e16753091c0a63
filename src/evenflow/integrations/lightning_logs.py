"""Lightning progress and logs under dynamic batches: [`EvenflowProgressBar`][EvenflowProgressBar] and
[`EvenflowModule`][EvenflowModule].

Re-exported by evenflow.integrations.lightning (import them from there). Why they exist: the train loader
gives Lightning's loop no ``len()`` (module docstring of evenflow.integrations.lightning), so the stock bar has
no total; and IDLE placeholder batches look like real ones to a reflexive ``self.log``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping

import torch
import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from torchmetrics import Metric

from ..step_info import STEP_INFO_KEY, StepInfo

__all__ = ["EvenflowModule", "EvenflowProgressBar"]


def _step_info(batch: object) -> StepInfo | None:
    info = batch.get(STEP_INFO_KEY) if isinstance(batch, Mapping) else None
    return info if isinstance(info, StepInfo) else None


class EvenflowProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose train total (and so its ETA) is the loader's step bound, refreshed every batch.

    The train loader has no ``len()`` for Lightning's loop (see the module docstring), which would leave the bar
    at ``11/--``. This bar reads each batch's ``StepInfo.steps_bound`` in ``on_train_batch_start`` (before
    ``training_step`` pops it): an upper bound on the epoch's steps, identical on every rank, that tightens as
    the epoch runs, never below the batches already trained. When the epoch ends the total becomes the exact
    count. Map-style datasets only: an ``IterableDataset``'s length is unknown until its end, so its bar shows no
    total (``steps_bound == -1``). For example, 96 samples on 2 ranks at ``token_budget=192``
    (tests/test_lightning.py) read ``1/48``, ``3/34``, ``5/21``, ``7/9``, then ``7/7`` at the epoch's end. Takes
    ``TQDMProgressBar``'s arguments; pass it in ``Trainer(callbacks=[...])``. The train loader keeps no ``len()``
    for Lightning's loop, so ``trainer.num_training_batches`` stays infinite and end-of-epoch validation runs.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._batches = 0        # batches of the current epoch that reached on_train_batch_end
        self._bounded = False    # the current epoch's batches carried a step bound (map-style)

    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._batches, self._bounded = 0, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        info = _step_info(batch)
        bar = self.train_progress_bar
        if info is None or info.steps_bound < 0 or bar is None:
            return
        self._bounded = True
        bar.total = max(info.steps_bound, batch_idx + 1)  # batch_idx + 1 batches will have run after this one
        if not bar.disable:
            bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batches = batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = self.train_progress_bar
        if self._bounded and bar is not None:  # the epoch's exact length is known now
            bar.total = bar.n = self._batches
            if not bar.disable:
                bar.refresh()
        super().on_train_epoch_end(trainer, pl_module)


_LOG_SIGNATURE = inspect.signature(L.LightningModule.log)


class EvenflowModule(L.LightningModule):
    """A ``LightningModule`` whose ``self.log`` / ``self.log_dict`` skip IDLE batches: subclass it instead.

    NOTE [ IDLE batches are not logged ]
        In join mode a rank that ran dry yields IDLE placeholder batches (``StepInfo.is_idle``): a real sample,
        trained with ``loss_scale == 0`` because DDP needs every rank's backward. Their model loss is a
        real-looking number, so ``self.log("train_loss", loss)`` in ``training_step`` would log a sample that
        was never trained (and pull ``on_epoch`` means towards it). Every ``training_step`` of a subclass is
        wrapped so that, while it runs on an IDLE batch, ``self.log`` returns without logging. Rank 0 IDLE at
        steps 7 and 8 of 9: ``train_loss_epoch`` averages its 7 real batches, and the placeholder's value never
        reaches a logger -- at steps 7 and 8 Lightning's loggers show step 6's value again (Lightning re-reports a
        key's latest ``on_step`` value at every logging step until the key is logged anew).

        ``sync_dist=True`` needs care, because ranks must stay in lockstep: with ``on_epoch`` only (and the
        default mean) the value is all-reduced at the epoch's end, so the call goes through with ``batch_size=0``
        (weight 0 in the mean; a skip could leave an all-IDLE rank without the name and hang its peers). With
        ``on_step`` (the default in ``training_step``) it is all-reduced inside ``self.log`` on every rank:
        skipping it on one rank would pair its peers' all-reduce with this rank's next collective, so that call
        goes through and warns once. Log ``scale_loss(loss, info)`` there instead (IDLE ranks contribute exactly
        0; for ``accumulate_grad_batches=1`` the mean over ranks is the exact global per-token loss), or log per
        rank.
        Values logged from other hooks (``on_train_batch_end`` ...) and ``torchmetrics`` objects updated by hand
        are the user's: check ``info.is_idle`` there.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._evenflow_idle = False          # inside training_step on an IDLE batch
        self._evenflow_warned: set = set()   # names warned about under sync_dist (once each)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        step = cls.__dict__.get("training_step")
        if step is not None and not getattr(step, "_evenflow_guard", False):
            cls.training_step = _guarded(step)

    def log(self, name: str, value, *args, **kwargs) -> None:
        """``LightningModule.log``, except inside ``training_step`` on an IDLE batch (NOTE [ IDLE batches are
        not logged ])."""
        if self._evenflow_idle:
            bound = _LOG_SIGNATURE.bind(self, name, value, *args, **kwargs).arguments
            if not bound.get("sync_dist", False) or isinstance(value, Metric):
                return  # nothing collective happens inside self.log (a Metric syncs in its own compute)
            if bound.get("on_step") is False and bound.get("reduce_fx", "mean") in ("mean", torch.mean):
                # All-reduced at the epoch's end: weight 0 adds nothing to the mean and keeps this rank in step.
                bound.pop("self")
                bound["batch_size"] = 0
                return super().log(**bound)
            if name not in self._evenflow_warned:
                self._evenflow_warned.add(name)
                warnings.warn(
                    f"evenflow: self.log({name!r}, ..., sync_dist=True) on an IDLE batch (this rank ran out of data; "
                    "the batch is a placeholder trained with loss_scale=0): the value is logged because sync_dist "
                    "all-reduces across ranks inside self.log and skipping it on one rank would desynchronize them. "
                    "Log evenflow.scale_loss(loss, info) with sync_dist=True (IDLE ranks add exactly 0), or log per "
                    "rank with sync_dist=False (IDLE batches are then skipped)", stacklevel=2)
        super().log(name, value, *args, **kwargs)


def _guarded(training_step):
    """Wrap a ``training_step`` so that ``EvenflowModule.log`` knows when it runs on an IDLE batch."""

    @functools.wraps(training_step)
    def step(self, batch, *args, **kwargs):
        info = _step_info(batch)
        outer = self._evenflow_idle
        # A subclass's training_step may call super().training_step after popping the info: keep the outer state.
        self._evenflow_idle = info.is_idle if info is not None else outer
        try:
            return training_step(self, batch, *args, **kwargs)
        finally:
            self._evenflow_idle = outer

    step._evenflow_guard = True
    return step
