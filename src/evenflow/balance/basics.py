"""Shared helpers of the balancers: loads, bounds, validation and the deterministic item order. Pure numpy."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .costs import as_costs

__all__ = ["loads", "makespan", "lower_bound"]


def loads(costs: Sequence[float] | np.ndarray, assignment: Sequence[int] | np.ndarray, num_ranks: int) -> np.ndarray:
    """Per-rank sum of item costs. ``loads([3, 1, 2], [0, 1, 0], 2)`` -> ``[5., 1.]``."""
    return np.bincount(np.asarray(assignment, dtype=np.int64), weights=np.asarray(costs, dtype=np.float64),
                       minlength=num_ranks).astype(np.float64)


def makespan(costs: Sequence[float] | np.ndarray, assignment: Sequence[int] | np.ndarray, num_ranks: int) -> float:
    """The most loaded rank's cost (0 with no items)."""
    return float(loads(costs, assignment, num_ranks).max(initial=0.0))


def lower_bound(costs: Sequence[float] | np.ndarray, num_ranks: int) -> float:
    """``max(largest item, mean load)``: no assignment does better."""
    arr = np.asarray(costs, dtype=np.float64)
    return float(max(arr.max(initial=0.0), arr.sum() / num_ranks))


def _check_ranks(num_ranks: int) -> int:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    return int(num_ranks)


def _order_desc(costs: np.ndarray) -> np.ndarray:
    # Non-negative float64 bit patterns order like the values; a stable sort of the negated int64 view gives
    # (cost descending, index ascending) ~40 % faster than a stable float sort.
    return np.argsort(-costs.view(np.int64), kind="stable")


def _cap_weights(costs: np.ndarray, cap: float | None,
                 cap_weights: Sequence[float] | np.ndarray | None) -> np.ndarray | None:
    if cap is None:
        if cap_weights is not None:
            raise ValueError("cap_weights were given without cap; pass cap=<per-rank limit> or drop cap_weights")
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)) or not cap > 0 \
            or not math.isfinite(cap):
        raise ValueError(f"cap must be a positive finite number (per-rank limit) or None, got {cap!r}")
    weights = costs if cap_weights is None else as_costs(cap_weights)
    if weights.shape != costs.shape:
        raise ValueError(f"cap_weights has {weights.size} entries for {costs.size} items; pass one per item")
    over = np.flatnonzero(weights > cap)
    if over.size:
        i = int(over[0])
        raise ValueError(f"item {i}: weight {weights[i]:g} exceeds cap={cap:g} on its own, so no rank can take it; "
                         "raise cap, split the item, or drop it upstream")
    return weights


def _equal_quota(n: int, num_ranks: int) -> tuple[int, int]:
    """(q, extra): every rank takes q items, ``extra`` ranks take one more."""
    return n // num_ranks, n % num_ranks
