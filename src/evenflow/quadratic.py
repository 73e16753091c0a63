"""``QuadraticCost``: ``gamma + alpha * L + beta * L**2``, the per-item cost every planner and balancer uses.

Its own light module (numpy only) because both the loader's planners (evenflow.planning.timecost, on the
per-step path) and the post-balancers (evenflow.balance.costs) build on it, and importing either package from
the other would pull that package's heavier imports into the other's path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["QuadraticCost"]


@dataclass(frozen=True, kw_only=True)
class QuadraticCost:
    """``gamma + alpha * L + beta * L**2``: the time (or FLOPs) of one item of length ``L`` in one phase.

    The default (``alpha=1``) counts tokens. ``QuadraticCost(alpha=24576, beta=1)`` is the attention-aware
    cost Megatron/verl use for a hidden size of 4096 (``6 * 4096`` per token for the linear layers).

    >>> QuadraticCost(gamma=1.0, alpha=2.0, beta=0.5)(4)
    17.0
    """

    gamma: float = 0.0
    """Fixed cost per item (kernel launches, per-item overheads)."""
    alpha: float = 1.0
    """Cost per token (linear layers)."""
    beta: float = 0.0
    """Cost per squared token (attention)."""

    def __post_init__(self) -> None:
        for name in ("gamma", "alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"{type(self).__name__}.{name} must be a finite number, got {value!r}")
            if value < 0:
                raise ValueError(f"{type(self).__name__}.{name}={value} is negative: a cost model must not make "
                                 "longer items cheaper; refit with more lengths or set the coefficient to 0")

    def __call__(self, length: float | np.ndarray) -> Any:
        lengths = np.asarray(length, dtype=np.float64)
        out = self.gamma + self.alpha * lengths + self.beta * lengths * lengths
        return float(out) if out.ndim == 0 else out
