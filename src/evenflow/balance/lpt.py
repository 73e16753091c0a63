"""LPT (longest processing time first) and swap refinement: the default balancer for up to thousands of items.

Every rank calls this on the same gathered metadata and must get the same plan: items go in ``(cost
descending, index ascending)`` order, ranks tie by index, and refinement stops on counts, never on a clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .basics import _cap_weights, _check_ranks, _equal_quota, _order_desc, loads
from .costs import as_costs

__all__ = ["lpt", "refine_swaps", "REFINE_GAP", "SWAP_PARTNERS"]

REFINE_GAP = 1e-3
"""Refinement stops once the max load is within this fraction of the lower bound (0.1 %: 20x below the
2 % locality tolerance, and it saves the long tail of tiny swaps)."""
SWAP_PARTNERS = 16
"""Ranks whose items are swap candidates in each refinement step: the least loaded ones (a swap with a
heavier rank gains less). All ranks when there are at most this many, so small instances are unaffected."""


def lpt(costs: Sequence[float] | np.ndarray, num_ranks: int, *, cap: float | None = None,
        cap_weights: Sequence[float] | np.ndarray | None = None, equal_counts: bool = False,
        refine: bool = True) -> np.ndarray:
    """Longest processing time first, then [`refine_swaps()`][refine_swaps]. Returns the rank of each item.

    Without constraints the max load is at most 4/3 of the optimum (Graham 1969); refinement only lowers it.
    ``cap`` bounds each rank's sum of ``cap_weights`` (default: the costs); ``equal_counts`` gives every
    rank ``n // R`` or ``n // R + 1`` items. Raises ``ValueError`` naming the item that found no room.

    >>> lpt([5, 4, 3, 3, 3], 2, refine=False).tolist()  # loads 8 / 10; 4/3 bound: OPT is 9
    [0, 1, 1, 0, 1]
    >>> lpt([5, 4, 3, 3, 3], 2).tolist()  # a swap of 4 and 3 reaches 9 / 9
    [0, 0, 1, 1, 1]
    """
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    weights = _cap_weights(arr, cap, cap_weights)
    order = _order_desc(arr)
    if weights is None or cap_weights is None:
        out = _lpt_heap(arr, order, num_ranks, cap if weights is not None else None, equal_counts)
    else:
        out = _lpt_weighted(arr, weights, order.tolist(), num_ranks, cap, equal_counts)
    if refine and arr.size:
        out = refine_swaps(arr, out, num_ranks, cap=cap, cap_weights=weights if cap is not None else None,
                           allow_moves=not equal_counts)
    return out


def _lpt_heap(arr: np.ndarray, order: np.ndarray, num_ranks: int, cap: float | None,
              equal_counts: bool) -> np.ndarray:
    """Heap of (load, rank): the least loaded rank, lowest index on ties. With a cap on the costs themselves,
    the least loaded rank is the only one that can fit an item if any can."""
    out = np.empty(arr.size, dtype=np.int64)
    heap = [(0.0, r) for r in range(num_ranks)]
    if cap is None and not equal_counts:
        # The common case, with nothing to check per item.
        dest, replace = [], heapq.heapreplace
        for v in arr[order].tolist():
            load, r = heap[0]
            dest.append(r)
            replace(heap, (load + v, r))
        out[order] = dest
        return out
    values = arr.tolist()
    q, extra = _equal_quota(arr.size, num_ranks)
    counts = [0] * num_ranks
    at_extra = 0
    for i in order.tolist():
        load, r = heap[0]
        while equal_counts and (counts[r] > q or (counts[r] == q and at_extra >= extra)):
            heapq.heappop(heap)  # a full rank never takes another item (the quotas sum to n: never empty)
            load, r = heap[0]
        if cap is not None and load + values[i] > cap:
            raise ValueError(_no_room(i, values[i], cap, "lpt"))
        out[i] = r
        counts[r] += 1
        if equal_counts and counts[r] == q + 1:
            at_extra += 1
        heapq.heapreplace(heap, (load + values[i], r))
    return out


def _lpt_weighted(arr: np.ndarray, weights: np.ndarray, order: list[int], num_ranks: int, cap: float,
                  equal_counts: bool) -> np.ndarray:
    """LPT under a cap on separate weights: the least loaded rank among those with room."""
    out = np.empty(arr.size, dtype=np.int64)
    load = np.zeros(num_ranks)
    used = np.zeros(num_ranks)
    counts = np.zeros(num_ranks, dtype=np.int64)
    q, extra = _equal_quota(arr.size, num_ranks)
    for i in order:
        ok = used + weights[i] <= cap
        if equal_counts:
            at_extra = int((counts > q).sum())
            ok &= (counts < q) | ((counts == q) & (at_extra < extra))
        if not ok.any():
            raise ValueError(_no_room(i, weights[i], cap, "lpt"))
        r = int(np.flatnonzero(ok)[np.argmin(load[ok])])
        out[i] = r
        load[r] += arr[i]
        used[r] += weights[i]
        counts[r] += 1
    return out


def _no_room(i: int, weight: float, cap: float, method: str) -> str:
    return (f"item {i}: no rank has room for its weight {weight:g} under cap={cap:g} ({method} is greedy and "
            "may miss a packing that exists); raise cap, add ranks, or use method='milp' for an exact search")


def refine_swaps(costs: Sequence[float] | np.ndarray, assignment: Sequence[int] | np.ndarray, num_ranks: int, *,
                 cap: float | None = None, cap_weights: Sequence[float] | np.ndarray | None = None,
                 allow_moves: bool = True, max_steps: int | None = None) -> np.ndarray:
    """Improve an assignment by moving one item, or swapping two, off the most loaded rank.

    Each step takes the most loaded rank ``a`` and the move or swap (with a rank ``b``) that minimizes
    ``max(new load of a, new load of b)``; it is taken only if that is below ``load(a)``. A step shifts
    ``0 < d < load(a) - load(b)``, which strictly lowers the sum of squared loads, so the loop terminates;
    ``max_steps`` (default ``4 * items``) bounds it by a count, and it stops once the max load is within
    ``REFINE_GAP`` of the lower bound ``max(largest item, mean)``. Moves are off with ``allow_moves=False``
    (keeps item counts). Swaps are searched with the items of the ``SWAP_PARTNERS`` least loaded ranks (all
    ranks when there are fewer): a step costs O(items on ``a`` x their items), not x all items -- 64 ranks x
    32 items took ~5 ms per step otherwise. For very large instances
    [`lpt_batched()`][evenflow.balance.batched.lpt_batched] uses a pairwise vectorized variant instead.

    >>> refine_swaps([4, 3, 3, 2], [0, 0, 1, 1], 2).tolist()  # loads 7 / 5 -> 6 / 6
    [1, 0, 0, 1]
    """
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    out = np.array(assignment, dtype=np.int64)
    weights = None if cap is None else (arr if cap_weights is None else np.asarray(cap_weights, dtype=np.float64))
    n = arr.size
    if n == 0 or num_ranks == 1:
        return out
    state = _SwapState(arr, out, weights, cap, num_ranks)
    good_enough = max(float(arr.max()), float(arr.sum()) / num_ranks) * (1 + REFINE_GAP)
    for _ in range(4 * n if max_steps is None else max_steps):
        a = int(np.argmax(state.rank_load))
        if state.rank_load[a] <= good_enough:
            break
        mine = np.flatnonzero(out == a)
        if mine.size == 0:
            break
        best = _best_move(state, a, mine) if allow_moves else (state.rank_load[a], None)
        best = min(best, _best_swap(state, a, mine), key=lambda v: v[0])
        if best[1] is None:
            break
        kind, i, j = best[1]
        if kind == "move":
            state.relocate(i, j)
        else:
            b = int(out[j])
            state.relocate(i, b)
            state.relocate(j, a)
    return out


class _SwapState:
    """Assignment, per-rank loads and cap usage, kept in step by [`relocate()`][relocate]."""

    def __init__(self, arr: np.ndarray, out: np.ndarray, weights: np.ndarray | None, cap: float | None,
                 num_ranks: int) -> None:
        self.arr, self.out, self.weights, self.cap = arr, out, weights, cap
        self.rank_load = loads(arr, out, num_ranks)
        self.used = None if weights is None else loads(weights, out, num_ranks)
        self.ranks = np.arange(num_ranks)

    def relocate(self, i: int, b: int) -> None:
        a = int(self.out[i])
        self.out[i] = b
        self.rank_load[a] -= self.arr[i]
        self.rank_load[b] += self.arr[i]
        if self.used is not None:
            self.used[a] -= self.weights[i]
            self.used[b] += self.weights[i]


def _best_move(state: _SwapState, a: int, mine: np.ndarray) -> tuple[float, tuple | None]:
    """Best (pair max, ("move", item, rank)) moving one item of ``a`` elsewhere: max(top - c, load_b + c)."""
    top = state.rank_load[a]
    ca = state.arr[mine]
    val = np.maximum(top - ca[:, None], state.rank_load[None, :] + ca[:, None])
    ok = (ca[:, None] > 0) & (state.ranks[None, :] != a)
    if state.used is not None:
        ok &= state.used[None, :] + state.weights[mine][:, None] <= state.cap
    val = np.where(ok, val, np.inf)
    flat = int(np.argmin(val))
    if val.flat[flat] < top:
        return float(val.flat[flat]), ("move", int(mine[flat // state.ranks.size]), int(flat % state.ranks.size))
    return float(top), None


def _best_swap(state: _SwapState, a: int, mine: np.ndarray) -> tuple[float, tuple | None]:
    """Best (pair max, ("swap", item of a, item elsewhere)) with ``0 < c_i - c_j``."""
    top = state.rank_load[a]
    partners = state.ranks
    if state.ranks.size > SWAP_PARTNERS:
        partners = np.argsort(state.rank_load, kind="stable")[:SWAP_PARTNERS]
        others = np.flatnonzero(np.isin(state.out, partners[partners != a]))
    else:
        others = np.flatnonzero(state.out != a)
    if not others.size:
        return float(top), None
    d = state.arr[mine][:, None] - state.arr[others][None, :]
    val = np.maximum(top - d, state.rank_load[state.out[others]][None, :] + d)
    ok = d > 0
    if state.used is not None:
        dw = state.weights[mine][:, None] - state.weights[others][None, :]
        ok &= (state.used[state.out[others]][None, :] + dw <= state.cap) & (state.used[a] - dw <= state.cap)
    val = np.where(ok, val, np.inf)
    flat = int(np.argmin(val))
    if val.flat[flat] < top:
        return float(val.flat[flat]), ("swap", int(mine[flat // others.size]), int(others[flat % others.size]))
    return float(top), None
