"""Exact min-max balancing as a MILP (HiGHS through ``scipy.optimize.milp``): small instances, test oracle."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .basics import _cap_weights, _check_ranks, _equal_quota, loads  # noqa: F401 - loads: the doctest
from .costs import as_costs

__all__ = ["milp_balance", "MILP_MAX_CELLS"]

MILP_MAX_CELLS = 20_000
"""``milp_balance`` has ``items x ranks`` binaries; beyond this HiGHS may not finish in a step."""


class _Rows:
    """Sparse constraint rows ``lo <= A x <= hi`` collected one row at a time."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def add(self, cols: np.ndarray, vals: np.ndarray, lower: float, upper: float) -> None:
        self.rows.append(np.full(cols.size, len(self.lo)))
        self.cols.append(cols)
        self.vals.append(vals)
        self.lo.append(lower)
        self.hi.append(upper)

    def matrix(self, num_vars: int):
        from scipy.sparse import coo_array

        return coo_array((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                         shape=(len(self.lo), num_vars)).tocsr()


def _constraints(arr: np.ndarray, num_ranks: int, weights: np.ndarray | None, cap: float | None,
                 equal_counts: bool) -> _Rows:
    """x[i, r] at column ``i * R + r``, then t: one rank per item, loads <= t, cap, counts, symmetry."""
    n = arr.size
    t_col = n * num_ranks
    items = np.arange(n)
    rows = _Rows()
    for i in range(n):
        rows.add(i * num_ranks + np.arange(num_ranks), np.ones(num_ranks), 1.0, 1.0)
    q, extra = _equal_quota(n, num_ranks)
    for r in range(num_ranks):
        mine = items * num_ranks + r
        rows.add(np.append(mine, t_col), np.append(arr, -1.0), -np.inf, 0.0)
        if weights is not None:
            rows.add(mine, weights, -np.inf, float(cap))
        if equal_counts:
            rows.add(mine, np.ones(n), float(q), float(q + (1 if extra else 0)))
        if r + 1 < num_ranks:  # load(r) >= load(r + 1): identical ranks are interchangeable
            rows.add(np.concatenate((mine, mine + 1)), np.concatenate((arr, -arr)), 0.0, np.inf)
    return rows


def milp_balance(costs: Sequence[float] | np.ndarray, num_ranks: int, *, cap: float | None = None,
                 cap_weights: Sequence[float] | np.ndarray | None = None, equal_counts: bool = False,
                 time_limit: float = 10.0) -> np.ndarray:
    """Exact min-max assignment as a MILP (HiGHS through ``scipy.optimize.milp``). Small instances only.

    Variables ``x[i, r]`` (item i on rank r) and ``t`` (the max load); minimize ``t`` subject to one rank per
    item, ``sum_i c_i x[i, r] <= t``, the optional cap and equal counts, and ``load(r) >= load(r + 1)`` to
    break the symmetry between identical ranks. After ``time_limit`` seconds the best solution found is
    returned (not proven optimal). Raises ``ValueError`` when the constraints admit no assignment.

    >>> sorted(loads([5, 4, 3, 3, 3], milp_balance([5, 4, 3, 3, 3], 2), 2).tolist())
    [9.0, 9.0]
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    weights = _cap_weights(arr, cap, cap_weights)
    n = arr.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if n * num_ranks > MILP_MAX_CELLS:
        raise ValueError(f"milp_balance would have {n} x {num_ranks} binaries (> {MILP_MAX_CELLS}); use "
                         "method='lpt' or 'kk' for instances this large")
    nv = n * num_ranks + 1
    rows = _constraints(arr, num_ranks, weights, cap, equal_counts)
    objective = np.zeros(nv)
    objective[-1] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    upper = np.ones(nv)
    upper[-1] = np.inf
    result = milp(objective, constraints=LinearConstraint(rows.matrix(nv), rows.lo, rows.hi),
                  integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
                  options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "disp": False})
    if result.x is None:
        if result.status == 2:
            raise ValueError(f"no assignment of {n} items to {num_ranks} ranks satisfies cap={cap} and "
                             f"equal_counts={equal_counts}; raise cap or add ranks")
        raise ValueError(f"milp_balance found no solution within time_limit={time_limit}s ({result.message}); "
                         "raise time_limit or use method='lpt'")
    return np.argmax(result.x[:-1].reshape(n, num_ranks), axis=1).astype(np.int64)
