"""Cost models for post-balancing: what one item (or one rank's batch) costs. Pure numpy.

Three shapes of cost, matching how a batch is collated:

* ``summed`` -- packed / varlen batches: a rank's cost is the sum of its items' costs ``f(L_i)``.
* ``padded`` -- right-padded batches: a rank holding ``n`` items costs ``n * f(max L)``; the longest item
  sets the row length of every row. Not additive: `evenflow.balance.planners.padded_partition()` solves
  it exactly.
* ``f`` itself is [`QuadraticCost`][QuadraticCost] ``gamma + alpha * L + beta * L**2`` per phase (linear layers are
  ``alpha * L``, attention is ``beta * L**2``, kernel launches are ``gamma``), or any ``cost_fn(item)``.

NOTE [ Fitting a phase's cost ]
    Time a phase on a few lengths and fit ``t ~ gamma + alpha * L + beta * L**2`` by least squares. The
    columns ``1, L, L**2`` span many orders of magnitude (L = 8192 gives L**2 = 6.7e7), so each column is
    scaled to unit norm before ``numpy.linalg.lstsq`` and the coefficients are unscaled afterwards; without
    that, the L**2 column swamps the others and gamma comes back as noise. Example: times measured as
    ``[3, 5, 9, 17]`` at lengths ``[1, 2, 4, 8]`` fit ``gamma=1, alpha=2, beta=0`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..quadratic import QuadraticCost

__all__ = ["QuadraticCost", "fit_quadratic", "item_costs", "summed_cost", "padded_cost", "as_costs"]

MIN_FIT_POINTS = 3
"""A quadratic has three coefficients: fewer distinct lengths leave it underdetermined."""


def fit_quadratic(lengths: Sequence[float] | np.ndarray, times: Sequence[float] | np.ndarray, *,
                  clip_negative: bool = True) -> QuadraticCost:
    """Least-squares fit of ``gamma, alpha, beta`` from measured ``(length, time)`` pairs.

    Needs at least three distinct lengths. A negative coefficient (noise on a phase that is really linear)
    is clipped to 0 and the others refit, unless ``clip_negative=False``, which raises instead.

    >>> c = fit_quadratic([1, 2, 4, 8], [3, 5, 9, 17])
    >>> round(c.gamma, 9), round(c.alpha, 9), round(c.beta, 9)
    (1.0, 2.0, 0.0)
    """
    x = np.asarray(lengths, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"lengths and times must be 1-D and of equal length, got shapes {x.shape} and {y.shape}")
    for name, arr in (("length", x), ("time", y)):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
        if bad.size:
            raise ValueError(f"measurement {int(bad[0])}: {name} {float(arr[bad[0]])!r} is not a finite non-negative "
                             "number; drop that measurement")
    if len(np.unique(x)) < MIN_FIT_POINTS:
        raise ValueError(f"fit_quadratic needs at least {MIN_FIT_POINTS} distinct lengths, got "
                         f"{len(np.unique(x))}; time the phase at more lengths (e.g. 256, 1024, 4096)")
    columns = np.stack([np.ones_like(x), x, x * x], axis=1)
    active = [0, 1, 2]
    while True:
        coef = _lstsq(columns[:, active], y)
        if not clip_negative or not active or (coef >= 0).all():
            break
        active.pop(int(np.argmin(coef)))  # drop the most negative term, refit the rest
    full = np.zeros(3)
    full[active] = coef
    # A term whose largest contribution is below float rounding of the largest time is noise: snap it to 0.
    contribution = np.abs(full) * np.abs(columns).max(axis=0)
    full[contribution <= 1e-12 * max(float(np.abs(y).max()), np.finfo(np.float64).tiny)] = 0.0
    if (full < 0).any():
        bad = ("gamma", "alpha", "beta")[int(np.argmin(full))]
        raise ValueError(f"the fitted {bad} is negative ({full.min():.3g}): the measurements do not look like a "
                         "cost that grows with length; check them or pass clip_negative=True")
    return QuadraticCost(gamma=float(full[0]), alpha=float(full[1]), beta=float(full[2]))


def _lstsq(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    # Unit-norm columns (NOTE [ Fitting a phase's cost ]), then unscale.
    scale = np.linalg.norm(design, axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(design / scale, y, rcond=None)
    return coef / scale


def as_costs(costs: Iterable[float] | np.ndarray, *, what: str = "item") -> np.ndarray:
    """Validate per-item costs: a 1-D float64 array of finite, non-negative numbers.

    Errors name the first bad position: ``item 3: cost nan is not finite ...``.
    """
    try:
        arr = np.asarray(list(costs) if not isinstance(costs, np.ndarray) else costs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"costs must be numbers (one per {what}): {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"costs must be a 1-D sequence (one number per {what}), got shape {arr.shape}")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(f"{what} {int(bad[0])}: cost {float(arr[bad[0]])!r} is not finite; fix the cost model or the "
                         f"{what}'s metadata")
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"{what} {int(bad[0])}: cost {float(arr[bad[0]])!r} is negative; costs are times or token "
                         "counts and must be >= 0")
    return arr + 0.0  # -0.0 -> 0.0, so bit patterns order like values (planners sort on them)


def item_costs(items: Iterable[Any], cost_fn: Callable[[Any], float]) -> np.ndarray:
    """``[cost_fn(item) for item in items]``, validated (finite, >= 0). Any callable works.

    >>> item_costs([{"len": 3}, {"len": 5}], lambda it: QuadraticCost(beta=1.0)(it["len"])).tolist()
    [12.0, 30.0]
    """
    values = []
    for i, item in enumerate(items):
        value = cost_fn(item)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"item {i}: cost_fn returned {value!r}, not a number; return a float") from None
        values.append(value)
    return as_costs(values)


def summed_cost(lengths: Sequence[float] | np.ndarray, f: Callable[[np.ndarray], np.ndarray] | None = None) -> float:
    """Cost of a packed (varlen) batch: ``sum(f(L_i))``; ``f`` defaults to the identity (tokens).

    >>> summed_cost([2, 3], QuadraticCost(gamma=1.0))
    7.0
    """
    arr = np.asarray(lengths, dtype=np.float64)
    return float(np.sum(arr if f is None else f(arr)))


def padded_cost(lengths: Sequence[float] | np.ndarray, f: Callable[[np.ndarray], np.ndarray] | None = None) -> float:
    """Cost of a right-padded batch: ``n * f(max L)``; 0 for an empty batch.

    >>> padded_cost([2, 3, 8])
    24.0
    """
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size == 0:
        return 0.0
    top = np.asarray(arr.max())
    return float(arr.size * (top if f is None else f(top)))
