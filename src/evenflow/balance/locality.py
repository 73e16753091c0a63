"""Locality: keep items on the rank that holds them when that costs little balance. Pure numpy.

NOTE [ Locality ]
    Balanced buckets rarely resemble what each rank already holds, so a fully balanced plan moves almost
    every item. With ``locality_tolerance = tol``, ``plan_balance`` also builds a plan that keeps items
    home: every rank keeps its own items (largest first, or most bytes per cost first) while its load stays
    under ``(1 + tol) * M`` (``M`` the balanced plan's max load); the rest go, largest first, to the least
    loaded rank of their own node if it has room, else to the least loaded rank anywhere. If they do not all
    fit under the limit, ranks keep a little less (98 %, 95 %, ... of it) and try again. The plan is used
    when it fits and moves fewer bytes. Example, tol = 0.02, loads [10, 10, 10, 14] in items of 1-4:
    M = 11 (balanced), limit 11.22: rank 3 keeps 11 and ships 3 -- 3 units move instead of ~all 44.
"""

from __future__ import annotations

import heapq

import numpy as np

from .topology import Topology, transfer_bytes

__all__ = ["LOCALITY_KEEP_FRACTIONS", "locality_plan"]


LOCALITY_KEEP_FRACTIONS = (1.0, 0.98, 0.95, 0.9, 0.8)
"""Keep thresholds tried by :func:`locality_plan`, as fractions of the limit: keeping a little less leaves room
to pack the shed items under the limit (a count, not a clock: every rank tries the same ones)."""


def locality_plan(costs: np.ndarray, sources: np.ndarray, num_ranks: int, limit: float, topology: Topology, *,
                  item_bytes: np.ndarray, cap: float | None = None,
                  cap_weights: np.ndarray | None = None) -> np.ndarray | None:
    """The plan that keeps the most bytes home with max load <= ``limit`` (NOTE [ Locality ]), or None.

    Two keep orders (bytes per cost, then cost -- both descending) times :data:`LOCALITY_KEEP_FRACTIONS`;
    for each order the first threshold whose shed items all fit under ``limit`` is a candidate; the one
    moving the fewest (inter-node, intra-node) bytes wins.
    """
    n = costs.size
    weights = costs if cap_weights is None else cap_weights
    room = np.inf if cap is None else float(cap)
    ratio = np.where(costs > 0, item_bytes / np.where(costs > 0, costs, 1.0), np.inf)
    best, best_moved = None, None
    for keys in ((np.arange(n), -costs, -ratio, sources), (np.arange(n), -ratio, -costs, sources)):
        keep_order = np.lexsort(keys)  # grouped by source rank, then the keep order
        for frac in LOCALITY_KEEP_FRACTIONS:
            plan = _home_plan(costs, weights, sources, keep_order, num_ranks, frac * limit, limit, room, topology)
            if plan is not None:
                moved = transfer_bytes(plan, sources, item_bytes, topology)
                if best_moved is None or moved < best_moved:
                    best, best_moved = plan, moved
                break  # lower thresholds only move more for this order
    return best


def _home_plan(costs: np.ndarray, weights: np.ndarray, sources: np.ndarray, keep_order: np.ndarray, num_ranks: int,
               keep_limit: float, limit: float, room: float, topology: Topology) -> np.ndarray | None:
    # Keep the longest prefix (in keep order) of each rank's items under keep_limit and the cap: vectorized.
    src = sources[keep_order]
    first = np.flatnonzero(np.concatenate(([True], src[1:] != src[:-1]))) if src.size else np.zeros(0, np.int64)
    seg = np.repeat(first, np.diff(np.append(first, src.size)))
    cum = np.cumsum(costs[keep_order])
    cum_w = np.cumsum(weights[keep_order])
    before = np.where(seg > 0, cum[seg - 1], 0.0)
    before_w = np.where(seg > 0, cum_w[seg - 1], 0.0)
    keep = (cum - before <= keep_limit) & (cum_w - before_w <= room)
    out = sources.copy()
    rank_load = np.bincount(src[keep], weights=costs[keep_order][keep], minlength=num_ranks).astype(np.float64)
    used = np.bincount(src[keep], weights=weights[keep_order][keep], minlength=num_ranks).astype(np.float64)
    shed = keep_order[~keep]
    if shed.size == 0:
        return out
    shed = shed[np.lexsort((shed, -costs[shed]))]  # largest first
    node_of = topology.node_of(np.arange(num_ranks))
    per_node = topology.ranks_per_node
    heap = [(float(rank_load[r]), r) for r in range(num_ranks)]
    heapq.heapify(heap)
    for i in shed.tolist():
        c, w = costs[i], weights[i]
        lo = int(node_of[sources[i]]) * per_node
        local_load = rank_load[lo:lo + per_node]
        fits = (local_load + c <= limit) & (used[lo:lo + per_node] + w <= room)
        if fits.any():
            cand = np.flatnonzero(fits)
            r = lo + int(cand[np.argmin(local_load[cand])])  # argmin: first (lowest rank) on ties
        else:
            while heap[0][0] != rank_load[heap[0][1]]:  # lazy heap: refresh stale entries
                _, stale = heapq.heappop(heap)
                heapq.heappush(heap, (float(rank_load[stale]), stale))
            r = heap[0][1]
            if used[r] + w > room:
                ok = np.flatnonzero((used + w <= room) & (rank_load + c <= limit))
                if ok.size == 0:
                    return None
                r = int(ok[np.argmin(rank_load[ok])])
        if rank_load[r] + c > limit:
            return None
        out[i] = r
        rank_load[r] += c
        used[r] += w
        heapq.heappush(heap, (float(rank_load[r]), r))
    return out
