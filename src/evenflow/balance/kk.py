"""Karmarkar-Karp (multi-way largest differencing): an option that is often tighter than LPT. Pure."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .basics import _check_ranks, _order_desc
from .costs import as_costs

__all__ = ["karmarkar_karp", "KK_MAX_CELLS"]

KK_MAX_CELLS = 4_000_000
"""Karmarkar-Karp keeps one ``num_ranks``-wide partial partition per item: refuse beyond this many cells."""


def karmarkar_karp(costs: Sequence[float] | np.ndarray, num_ranks: int) -> np.ndarray:
    """Multi-way largest differencing (Karmarkar & Karp 1982). Returns the rank of each item.

    Every item starts as a partial partition ``[c, 0, ..., 0]``. Repeatedly merge the two partials with the
    largest spread (max - min), pairing the heaviest subset of one with the lightest of the other, until one
    partition remains. Ties break by creation order, so the result is deterministic.

    >>> karmarkar_karp([8, 7, 6, 5, 4], 2).tolist()  # loads 16 / 14 (OPT is 15 / 15: a heuristic)
    [1, 0, 1, 0, 0]
    """
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    n = arr.size
    if n * num_ranks > KK_MAX_CELLS:
        raise ValueError(f"karmarkar_karp keeps {n} x {num_ranks} partial sums (> {KK_MAX_CELLS}); use "
                         "method='lpt_batched' for instances this large")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # A partial partition: (sums descending, subsets as nested lists flattened at the end).
    heap: list[tuple[float, int, np.ndarray, list]] = []
    for seq, i in enumerate(_order_desc(arr).tolist()):
        sums = np.zeros(num_ranks)
        sums[0] = arr[i]
        subsets: list = [[i]] + [[] for _ in range(num_ranks - 1)]
        heap.append((-float(arr[i]), seq, sums, subsets))
    heapq.heapify(heap)
    seq = n
    while len(heap) > 1:
        _, _, s1, p1 = heapq.heappop(heap)
        _, _, s2, p2 = heapq.heappop(heap)
        sums = s1 + s2[::-1]
        subsets = [[p1[k], p2[num_ranks - 1 - k]] for k in range(num_ranks)]
        order = np.lexsort((np.arange(num_ranks), -sums))
        sums = sums[order]
        subsets = [subsets[k] for k in order.tolist()]
        heapq.heappush(heap, (-(float(sums[0] - sums[-1])), seq, sums, subsets))
        seq += 1
    return _flatten(heap[0][3], n)


def _flatten(subsets: list, n: int) -> np.ndarray:
    """Rank of each item from the final partition's nested subsets (iterative: deep nests are common)."""
    out = np.empty(n, dtype=np.int64)
    for r, nested in enumerate(subsets):
        stack = [nested]
        while stack:
            node = stack.pop()
            for x in node:
                if isinstance(x, list):
                    stack.append(x)
                else:
                    out[x] = r
    return out
