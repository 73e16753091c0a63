"""Loss weights: make per-rank mean losses into the exact global per-token mean. Pure.

NOTE [ Loss scale ]
    Rank r holds t_r supervised tokens at a micro-step; its loss is the mean over them, m_r = S_r / t_r.
    DDP averages gradients over W ranks, and gradient accumulation *sums* them over the k micro-steps of a
    window. The single-process reference is (sum over the window and all ranks of S) / T_tok with
    T_tok = sum over the window of sum_r t_r. Backpropagating

        m_r * W * t_r / T_tok   ( = S_r * W / T_tok )

    on every rank and micro-step gives exactly that gradient: DDP's 1/W cancels W, the sum over ranks and
    micro-steps rebuilds the numerator. Example: W = 2, one micro-step, t = [3, 1], m = [2.0, 6.0]:
    reference (3*2 + 1*6) / 4 = 3.0; scaled losses 2*2*3/4 = 3.0 and 6*2*1/4 = 3.0, averaged by DDP: 3.0.
    Do *not* divide by k as well. A window with T_tok = 0 has scale 0 (finite), never NaN.

    On a mesh with context or sequence parallelism (degree C), the C peers of a data-parallel group split its
    batch and the framework averages gradients over all W x C ranks; each token sits in one shard, so t_r and
    T_tok stay the group's counts (each token once) and the rank count is W x C: rank (r, c) backpropagates
    its shard's sum S_{r,c} x W C / T_tok, and the mean over W x C ranks is sum S / T_tok. Counting tokens per
    shard rank instead inflates T_tok by C; dividing by C again on top of the mean undercounts by C.

"Supervised tokens" are exactly the tokens the loss sums over. A causal LM predicts token i+1 from
position i, so with labels shifted inside the model (HF convention) the count is ``labels[1:] != -100``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "LossTokenRule", "count_loss_tokens", "loss_scale", "window_totals", "step_loss_scales"]

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class LossTokenRule:
    """Which label positions the loss sums over."""

    ignore_index: int = IGNORE_INDEX
    shift: bool = True
    """Causal-LM label shift: the first label is never predicted. ``False`` counts every non-ignored label."""


def count_loss_tokens(labels: Sequence[int] | np.ndarray | None, rule: LossTokenRule = LossTokenRule()) -> int:
    """Supervised tokens of one sample: ``[-100, -100, 5, 6]`` -> 2 (``5`` is predicted from position 1).

    ``labels=None`` means "every token is a label" is *not* assumed: pass labels, or count 0.
    """
    if labels is None:
        return 0
    arr = np.asarray(labels)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if rule.shift:
        arr = arr[1:]
    return int(np.count_nonzero(arr != rule.ignore_index))


def loss_scale(local_tokens: int, global_tokens: int, world_size: int) -> float:
    """``W * t_r / T_tok`` (NOTE [ Loss scale ]); 0.0 when ``T_tok == 0`` or ``t_r == 0``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if local_tokens < 0 or global_tokens < 0 or local_tokens > global_tokens:
        raise ValueError(f"inconsistent token counts: local {local_tokens} > global {global_tokens} or negative")
    if global_tokens == 0 or local_tokens == 0:
        return 0.0
    return world_size * local_tokens / global_tokens


def window_totals(step_totals: Sequence[int], window: int) -> list[int]:
    """Per step, the global supervised tokens of its accumulation window of ``window`` micro-steps.

    Windows are consecutive runs of ``window`` steps; the last one may be shorter (the epoch's tail).

    >>> window_totals([3, 1, 4, 1, 5], 2)
    [4, 4, 5, 5, 5]
    """
    if window < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {window}")
    out: list[int] = []
    for start in range(0, len(step_totals), window):
        chunk = step_totals[start:start + window]
        out.extend([int(sum(chunk))] * len(chunk))
    return out


def step_loss_scales(local: np.ndarray, window: int = 1) -> np.ndarray:
    """Loss scales for a whole run: ``local[step, rank]`` supervised tokens -> ``scale[step, rank]``."""
    local = np.asarray(local, dtype=np.int64)
    steps, world = local.shape
    totals = window_totals(local.sum(axis=1).tolist(), window)
    return np.array([[loss_scale(int(local[s, r]), totals[s], world) for r in range(world)] for s in range(steps)],
                    dtype=np.float64).reshape(steps, world)
