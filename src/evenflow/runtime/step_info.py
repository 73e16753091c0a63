"""StepInfo: what the loader knows about a step, attached to the batch after the user's collate_fn."""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch

__all__ = ["STEP_INFO_KEY", "StepInfo", "pop_step_info", "scale_loss"]

STEP_INFO_KEY = "evenflow_step_info"
"""Reserved batch key. The loader adds it *after* ``collate_fn``, so a collate that keeps only known keys
cannot lose it; :func:`pop_step_info` removes it before the batch reaches the model."""


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

    @property
    def imbalance(self) -> float:
        """Per-step max/mean cost across ranks (1.0 is perfect)."""
        return self.max_padded_tokens / self.mean_padded_tokens if self.mean_padded_tokens else 1.0


def pop_step_info(batch: MutableMapping) -> StepInfo:
    """Remove and return the loader's :class:`StepInfo` from a batch (call before ``model(**batch)``)."""
    try:
        info = batch.pop(STEP_INFO_KEY)
    except (KeyError, AttributeError, TypeError):
        raise KeyError(f"batch has no {STEP_INFO_KEY!r} entry: pass a batch yielded by evenflow.DynamicBatchLoader "
                       "(and call pop_step_info once per batch)") from None
    return info


def scale_loss(loss: torch.Tensor, info: StepInfo, *, reduction: str = "mean") -> torch.Tensor:
    """Make this rank's loss into its share of the exact global per-token mean.

    ``reduction="mean"``: ``loss`` is the mean over this rank's supervised tokens -> ``loss * info.loss_scale``.
    ``reduction="sum"``: ``loss`` is the sum over them -> ``loss * W / window_loss_tokens``. Use "sum" when a
    rank's batch may hold no supervised token at all (its mean is 0/0 = NaN, and NaN * 0 is still NaN).
    IDLE steps scale by exactly 0, so their gradients are zero. Do not also divide by ``grad_accum_steps``.
    """
    if reduction == "mean":
        return loss * info.loss_scale
    if reduction == "sum":
        factor = info.world_size / info.window_loss_tokens if info.window_loss_tokens and not info.is_idle else 0.0
        return loss * factor
    raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
