"""StepInfo: what the loader knows about a step, attached to the batch after the user's collate_fn."""

from __future__ import annotations

from collections import deque
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import StepInfoMisuse

__all__ = ["STEP_INFO_KEY", "LoaderTerms", "StepInfo", "StepInfoMisuse", "UsageCheck", "UsageTracker",
           "pop_step_info", "scale_loss"]

STEP_INFO_KEY = "evenflow_step_info"
"""Reserved batch key. The loader adds it *after* ``collate_fn``, so a collate that keeps only known keys
cannot lose it; [`pop_step_info()`][pop_step_info] removes it before the batch reaches the model."""


class _Receipt:
    """What saw one StepInfo: ``pop_step_info`` / an integration (``taken``), ``scale_loss`` (``scaled``).

    NOTE [ Misuse is loud ]
        The step info rides in the batch dict, and HF models swallow unknown keys in ``**kwargs``: a loop that
        forgets ``pop_step_info`` would train on an unscaled loss without a word. So the StepInfo (ours, not the
        user's batch dict, which may be copied or rebuilt) records who took it, and the loader checks, a few
        fetches later, that every batch it handed out had its info taken (``usage_check="taken"``) or its loss
        scaled (``"scaled"``), raising [`StepInfoMisuse`][StepInfoMisuse] with the fix otherwise. "A few fetches later"
        because trainers fetch ahead: Lightning one batch, HF a whole accumulation window.
    """

    __slots__ = ("taken", "scaled", "terms")

    def __init__(self) -> None:
        self.taken = False
        self.scaled = False
        self.terms: LoaderTerms | None = None


@dataclass(frozen=True)
class LoaderTerms:
    """The loader settings a step that consumes its batches must agree with (``StepInfo.loader_terms``)."""

    max_encoder_rows: int | None
    """The loader's encoder budget: patch rows before merging per batch (``None``: no such budget)."""
    timeout_s: float
    """The loader's ``timeout``: a step's own waits stay below it, so their error reaches peers first."""


@dataclass(frozen=True)
class StepInfo:
    """One step on one rank. All values are plain Python numbers or lists."""

    step: int
    """Step index within the epoch (identical on every rank)."""
    epoch: int
    is_idle: bool
    """This rank had no data for this step; the batch is a real-shaped placeholder with ``loss_scale=0``."""
    local_samples: int
    global_samples: int
    local_loss_tokens: int
    """Supervised tokens on this rank (the tokens the loss sums over; see ``LossTokenRule``)."""
    global_loss_tokens: int
    """Supervised tokens of this step summed over all ranks."""
    loss_scale: float
    """``W * local_loss_tokens / window_loss_tokens`` (NOTE [ Loss scale ] in evenflow.planning.loss)."""
    padded_tokens: int
    """Cost of this rank's batch under the configured cost model (padded or summed tokens)."""
    real_tokens: int
    sample_ids: list = field(default_factory=list)
    """Dataset indices (map-style) or stream positions (iterable); empty for IDLE."""
    world_size: int = 1
    window_loss_tokens: int = 0
    """Global supervised tokens of the gradient-accumulation window this step belongs to."""
    window_end: bool = True
    """The last micro-step of its accumulation window: step the optimizer after this one."""
    max_padded_tokens: int = 0
    """Largest ``padded_tokens`` over ranks at this step (imbalance = max / mean)."""
    mean_padded_tokens: float = 0.0
    global_real_tokens: int = 0
    """Real (unpadded) tokens of this step summed over all ranks."""
    steps_bound: int = -1
    """Upper bound on this epoch's total steps as known at this step (``len(loader)``), -1 if unknown."""
    shard_degree: int = 1
    """CP/SP ranks that split this batch (``mesh=``): gradients are averaged over ``world_size x shard_degree``
    ranks, which ``loss_scale`` and ``scale_loss`` count; the token counts are the data-parallel group's."""
    receipt: _Receipt = field(default_factory=_Receipt, init=False, repr=False, compare=False)
    """Who saw this info (NOTE [ Misuse is loud ]); a copy made with ``dataclasses.replace`` starts unseen."""

    @property
    def loader_terms(self) -> LoaderTerms | None:
        """The settings of the loader that yielded this step (``None``: a StepInfo built by hand)."""
        return self.receipt.terms

    def set_loader_terms(self, terms: LoaderTerms) -> None:
        """Record the yielding loader's settings (done by the loader)."""
        self.receipt.terms = terms

    def mark_taken(self) -> None:
        """Record that this step's info was taken out of its batch (done by ``pop_step_info`` and integrations)."""
        self.receipt.taken = True

    def mark_scaled(self) -> None:
        """Record that this step's loss was scaled by it (done by ``scale_loss``; call it if you scale yourself)."""
        self.receipt.taken = self.receipt.scaled = True

    @property
    def imbalance(self) -> float:
        """Per-step max/mean cost across ranks (1.0 is perfect)."""
        return self.max_padded_tokens / self.mean_padded_tokens if self.mean_padded_tokens else 1.0


def pop_step_info(batch: MutableMapping) -> StepInfo:
    """Remove and return the loader's [`StepInfo`][StepInfo] from a batch (call before ``model(**batch)``)."""
    try:
        info = batch.pop(STEP_INFO_KEY)
    except (KeyError, AttributeError, TypeError):
        raise KeyError(f"batch has no {STEP_INFO_KEY!r} entry: pass a batch yielded by evenflow.DynamicBatchLoader "
                       "(and call pop_step_info once per batch)") from None
    if isinstance(info, StepInfo):
        info.mark_taken()
    return info


def scale_loss(loss: torch.Tensor, info: StepInfo, *, reduction: str = "mean") -> torch.Tensor:
    """Make this rank's loss into its share of the exact global per-token mean.

    ``reduction="mean"``: ``loss`` is the mean over this rank's supervised tokens -> ``loss * info.loss_scale``.
    ``reduction="sum"``: ``loss`` is the sum over them -> ``loss * W / window_loss_tokens``. Use "sum" when a
    rank's batch may hold no supervised token at all (its mean is 0/0 = NaN, and NaN * 0 is still NaN).
    On a CP/SP mesh ``W`` is ``world_size x shard_degree`` and "sum" is the natural form: a rank sums over its
    shard's ``shift_labels``; "mean" then means that sum divided by ``local_loss_tokens`` (the group's count).
    IDLE steps scale by exactly 0, so their gradients are zero. Do not also divide by ``grad_accum_steps``.
    """
    if not isinstance(info, StepInfo):
        raise TypeError(f"scale_loss(loss, info): info must be the StepInfo from pop_step_info(batch), got "
                        f"{type(info).__name__}")
    info.mark_scaled()
    if reduction == "mean":
        return loss * info.loss_scale
    if reduction == "sum":
        ranks = info.world_size * info.shard_degree
        factor = ranks / info.window_loss_tokens if info.window_loss_tokens and not info.is_idle else 0.0
        return loss * factor
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


UsageCheck = Literal["taken", "scaled", "off"]
_FIXES = {
    "taken": "call `info = evenflow.pop_step_info(batch)` before `model(**batch)` and scale the loss with "
             "`evenflow.scale_loss(loss, info)` (a balanced VLM step takes the info itself: `vlm(batch, info)`)",
    "scaled": "backpropagate `evenflow.scale_loss(loss, info)` (or call `info.mark_scaled()` where you apply "
              "`info.loss_scale` yourself)",
}


class UsageTracker:
    """The loader's side of NOTE [ Misuse is loud ]: checks each handed-out StepInfo ``lag`` fetches later.

    With ``lag = 2`` the info of batch 0 is checked when batch 3 is fetched: by then a plain loop, Lightning
    (one batch ahead) and HF (``gradient_accumulation_steps`` ahead, ``lag = accum + 1``) have all run batch 0.
    The last ``lag`` batches of an epoch are not checked (the consumer may have stopped there on purpose).
    """

    def __init__(self, mode: UsageCheck, *, lag: int) -> None:
        if mode not in ("taken", "scaled", "off"):
            raise ValueError(f"usage_check must be 'taken', 'scaled' or 'off', got {mode!r}")
        self.mode = mode
        self.lag = lag
        self._pending: deque = deque()

    def handed_out(self, info: StepInfo) -> None:
        if self.mode != "off":
            self._pending.append(info)

    def check(self, rank: int) -> None:
        """Raise [`StepInfoMisuse`][StepInfoMisuse] for the oldest batch past the lag that was not taken / scaled."""
        while len(self._pending) > self.lag:
            info = self._pending.popleft()
            seen = info.receipt.scaled if self.mode == "scaled" else info.receipt.taken
            if not seen:
                what = "its loss was never passed to scale_loss" if self.mode == "scaled" and info.receipt.taken \
                    else "its StepInfo was never taken out of the batch (the model's **kwargs may have swallowed it)"
                raise StepInfoMisuse(
                    f"evenflow: rank {rank}, epoch {info.epoch}, step {info.step} (samples {info.sample_ids[:8]}): "
                    f"{what}, so the loss was not scaled to the exact global per-token mean. Fix: {_FIXES[self.mode]}. "
                    f"Trainer integrations do this for you; DynamicBatchLoader(usage_check='off') turns the check off")

    def reset(self) -> None:
        self._pending.clear()
