"""Exact min-max balancing for right-padded batches, where a rank costs ``n * f(max L)``. Pure numpy.

Padded cost is not additive -- one long sample raises the cost of every row -- so LPT on per-item costs
would misjudge it. It is solved exactly instead (NOTE [ Padded balancing is contiguous ]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .costs import as_costs
from .planners import _check_ranks, _order_desc

__all__ = ["padded_partition", "padded_loads"]


def padded_loads(unit_costs: Sequence[float] | np.ndarray, assignment: Sequence[int] | np.ndarray,
                 num_ranks: int) -> np.ndarray:
    """Per-rank padded cost ``count * max unit cost`` (0 for an empty rank)."""
    u = np.asarray(unit_costs, dtype=np.float64)
    a = np.asarray(assignment, dtype=np.int64)
    counts = np.bincount(a, minlength=num_ranks)
    top = np.zeros(num_ranks)
    np.maximum.at(top, a, u)
    return counts * top


def padded_partition(unit_costs: Sequence[float] | np.ndarray, num_ranks: int, *,
                     fill_ranks: bool = True) -> np.ndarray:
    """Exact min-max split of items into ``num_ranks`` right-padded batches. Returns a bucket per item.

    ``unit_costs[i] = f(L_i)`` for a nondecreasing ``f``; a bucket costs ``len(bucket) * max unit cost``.
    Buckets are numbered from the one holding the longest items (0) down; with ``fill_ranks`` (default)
    buckets are split until ``min(n, num_ranks)`` are non-empty, which never raises the max.

    NOTE [ Padded balancing is contiguous ]
        Sort by unit cost, descending. Some optimal solution gives every bucket a contiguous run: take any
        optimal one; the bucket B holding the longest item costs |B| * u_0 whatever else it holds, so swap
        into B the |B| longest items -- B's cost is unchanged and every other bucket trades items for shorter
        ones, so no cost rises. Recurse on the rest. For a target T, taking the longest feasible run from the
        top (``floor(T / u_p)`` items) and repeating uses the fewest runs (the exchange argument of NOTE
        [ Padded grouping is optimal ] in [`evenflow.planning.grouping`][evenflow.planning.grouping]). T* is then found
        by bisection that always snaps ``hi`` to a realized partition cost. Example, 2 ranks, lengths [8, 5, 4, 4, 3]:
        T = 16 gives runs [8, 5] (2 * 8) and [4, 4, 3] (3 * 4 = 12); T = 15 gives [8], [5, 4, 4] and [3] --
        three runs, infeasible; so T* = 16.

    >>> padded_partition([4, 8, 3, 5, 4], 2).tolist()
    [1, 0, 1, 0, 1]
    """
    u = as_costs(unit_costs)
    num_ranks = _check_ranks(num_ranks)
    n = u.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    order = _order_desc(u)
    su = u[order]
    runs = _padded_runs(su, num_ranks)
    if fill_ranks:
        runs = _split_runs(su, runs, min(n, num_ranks))
    out = np.empty(n, dtype=np.int64)
    for b, (s, e) in enumerate(runs):
        out[order[s:e]] = b
    return out


def _greedy_runs(su: np.ndarray, target: float, limit: int) -> list[tuple[int, int]] | None:
    """Longest feasible runs from the top under ``target``; None when more than ``limit`` are needed."""
    n = su.size
    runs = []
    p = 0
    while p < n:
        if len(runs) == limit or su[p] > target:
            return None
        if su[p] == 0:
            k = n - p
        else:
            k = int(target // su[p])
            if (k + 1) * su[p] <= target:  # guard float division rounding down an exact multiple
                k += 1
            while k > 0 and k * su[p] > target:
                k -= 1
            k = max(1, min(k, n - p))
        runs.append((p, p + k))
        p += k
    return runs


def _runs_cost(su: np.ndarray, runs: list[tuple[int, int]]) -> float:
    return max(((e - s) * float(su[s]) for s, e in runs), default=0.0)


def _padded_runs(su: np.ndarray, num_ranks: int) -> list[tuple[int, int]]:
    n = su.size
    best = _greedy_runs(su, n * float(su[0]), num_ranks)
    assert best is not None
    hi = _runs_cost(su, best)
    lo = max(float(su[0]), float(np.sum(su)) / num_ranks) * (1 - 1e-12)  # strictly below any feasible T
    lo = min(lo, np.nextafter(hi, -np.inf))
    for _ in range(200):
        if not lo < hi or np.nextafter(lo, np.inf) >= hi:
            break
        mid = lo + (hi - lo) / 2
        runs = _greedy_runs(su, mid, num_ranks)
        if runs is None:
            lo = mid
        else:
            best, hi = runs, _runs_cost(su, runs)
    return best


def _split_runs(su: np.ndarray, runs: list[tuple[int, int]], want: int) -> list[tuple[int, int]]:
    """Split the costliest run (ties: the earliest) at its best point until ``want`` runs exist."""
    runs = list(runs)
    while len(runs) < want:
        cand = [(-(e - s) * float(su[s]), k) for k, (s, e) in enumerate(runs) if e - s >= 2]
        if not cand:
            break
        _, k = min(cand)
        s, e = runs[k]
        split = min(range(s + 1, e), key=lambda m: (max((m - s) * su[s], (e - m) * su[m]), m))
        runs[k:k + 1] = [(s, split), (split, e)]
    return runs
