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
    A try whose shed items cannot fit by counting alone is given up before placing any of them
    ([`_cannot_fit()`][_cannot_fit]: the ``k`` largest cost at least ``t`` each, and a rank with room ``rho`` under the
    limit holds at most ``floor(rho / t)`` of them) -- the same answer, without placing thousands of items one
    by one (at 2,560 ranks, a phase of 2-s audio pieces failed all ten tries, ~15 ms each). And when the full
    limit fails, the lowest threshold is tried next; if that fails too, the order is given up without the
    thresholds between. A greedy placement is not monotone in the threshold, so this can miss a plan a middle
    threshold had (3 of 276 keep orders of the simulated three-modality steps, 188 of 6,000 random
    ``plan_balance`` cases): that phase then moves more bytes, never less balanced; where nothing fits, it saves
    three of five tries.
"""

from __future__ import annotations

import heapq

import numpy as np

from .topology import Topology, transfer_bytes

__all__ = ["LOCALITY_KEEP_FRACTIONS", "locality_plan"]


LOCALITY_KEEP_FRACTIONS = (1.0, 0.98, 0.95, 0.9, 0.8)
"""Keep thresholds tried by [`locality_plan()`][locality_plan], as fractions of the limit: keeping a little less leaves
room to pack the shed items under the limit (a count, not a clock: every rank tries the same ones)."""


def locality_plan(costs: np.ndarray, sources: np.ndarray, num_ranks: int, limit: float, topology: Topology, *,
                  item_bytes: np.ndarray, cap: float | None = None,
                  cap_weights: np.ndarray | None = None) -> np.ndarray | None:
    """The plan that keeps the most bytes home with max load <= ``limit`` (NOTE [ Locality ]), or None.

    Two keep orders (bytes per cost, or cost -- descending, ties by index) times
    [`LOCALITY_KEEP_FRACTIONS`][LOCALITY_KEEP_FRACTIONS];
    for each order the first threshold whose shed items all fit under ``limit`` is a candidate; the one
    moving the fewest (inter-node, intra-node) bytes wins.
    """
    weights = costs if cap_weights is None else cap_weights
    room = np.inf if cap is None else float(cap)
    ratio = np.where(costs > 0, item_bytes / np.where(costs > 0, costs, 1.0), np.inf)
    best, best_moved = None, None
    for key in (-ratio, -costs):
        prefix = _Prefix(costs, weights, sources, _keep_order(key, sources))
        plan = _first_fit(costs, weights, sources, prefix, num_ranks, limit, room, topology)
        if plan is not None:
            moved = transfer_bytes(plan, sources, item_bytes, topology)
            if best_moved is None or moved < best_moved:
                best, best_moved = plan, moved
    return best


def _first_fit(costs, weights, sources, prefix, num_ranks, limit, room, topology) -> np.ndarray | None:
    """The plan at the highest keep threshold whose shed items fit (lower thresholds only move more). The full
    limit first; if it fails, the lowest threshold, and the ones between only if that one fits: a phase where
    nothing fits (2-s audio pieces at 2,560 ranks) costs two tries, not five (NOTE [ Locality ])."""
    def attempt(frac: float) -> np.ndarray | None:
        return _home_plan(costs, weights, sources, prefix, num_ranks, frac * limit, limit, room, topology)

    first, *between, last = LOCALITY_KEEP_FRACTIONS
    plan = attempt(first)
    if plan is not None:
        return plan
    lowest = attempt(last)
    if lowest is None:
        return None
    for frac in between:
        plan = attempt(frac)
        if plan is not None:
            return plan
    return lowest


def _keep_order(key: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """Items grouped by source rank, each group by (key, index) ascending: two stable single-key sorts (the
    rank key as a radix pass) instead of a multi-key lexsort -- ~2x faster at 81,920 items."""
    order = np.argsort(key, kind="stable")
    if sources.size and sources.max() < (1 << 16):
        return order[np.argsort(sources[order].astype(np.uint16), kind="stable")]
    return order[np.argsort(sources[order], kind="stable")]


class _Prefix:
    """Per keep order, computed once: each item's running cost (and weight) within its source's run."""

    def __init__(self, costs: np.ndarray, weights: np.ndarray, sources: np.ndarray, order: np.ndarray) -> None:
        self.order = order
        self.src = sources[order]
        src = self.src
        first = np.flatnonzero(np.concatenate(([True], src[1:] != src[:-1]))) if src.size else np.zeros(0, np.int64)
        seg = np.repeat(first, np.diff(np.append(first, src.size)))
        self.cost = costs[order]
        self.weight = weights[order]
        cum, cum_w = np.cumsum(self.cost), np.cumsum(self.weight)
        self.within = cum - np.where(seg > 0, cum[seg - 1], 0.0)
        self.within_w = cum_w - np.where(seg > 0, cum_w[seg - 1], 0.0)


def _home_plan(costs: np.ndarray, weights: np.ndarray, sources: np.ndarray, prefix: _Prefix, num_ranks: int,
               keep_limit: float, limit: float, room: float, topology: Topology) -> np.ndarray | None:
    # Each rank keeps the longest prefix (in keep order) of its items under keep_limit and the cap.
    keep = (prefix.within <= keep_limit) & (prefix.within_w <= room)
    rank_load = np.bincount(prefix.src[keep], weights=prefix.cost[keep], minlength=num_ranks).astype(np.float64)
    used = np.bincount(prefix.src[keep], weights=prefix.weight[keep], minlength=num_ranks).astype(np.float64)
    shed = prefix.order[~keep]
    out = sources.copy()
    if shed.size == 0:
        return out
    shed = np.sort(shed)
    shed = shed[np.argsort(-costs[shed], kind="stable")]  # largest first, ties by index
    if _cannot_fit(costs[shed], rank_load, limit):
        return None
    if np.isfinite(room):
        placed = _place_capped(costs, weights, sources, shed, rank_load, used, limit, room, topology)
    elif shed.size <= SHED_HEAP_PER_RANK * num_ranks:
        placed = _place_heap(costs, sources, shed, rank_load, limit, topology)
    else:
        placed = _place_batched(costs, shed, rank_load, limit)
    if placed is None:
        return None
    out[shed] = placed
    return out


CERTIFICATE_RUNS = 16
"""[`_cannot_fit()`][_cannot_fit] counts at the end of this many of the longest runs of equal cost (and at powers of
two): equal pieces (whole audio windows, same-sized frames) are where the room fragments."""
_ROUNDING = 1e-9
"""Relative slack on each rank's room in the count, so float rounding can only make it more permissive than
the placement (which adds costs one by one): it never gives up a try that would fit."""


def _cannot_fit(sizes: np.ndarray, rank_load: np.ndarray, limit: float) -> bool:
    """True when items of ``sizes`` (descending) provably do not all fit on ranks loaded ``rank_load`` under
    ``limit``, by any placement: for some ``k``, the ``k`` largest cost ``>= t = sizes[k - 1]`` each, and a rank
    with room ``rho`` holds at most ``floor(rho / t)`` of them. Rooms 5, 5 and three items of 3: ``k = 3``
    needs 3 slots of >= 3, there are 1 + 1 -- no placement fits. ``False`` proves nothing."""
    n = sizes.size
    if n == 0:
        return False
    room = np.maximum(limit - rank_load, 0.0) * (1 + _ROUNDING)
    ends = np.append(np.flatnonzero(sizes[1:] != sizes[:-1]) + 1, n)  # k at the end of each run of equal sizes
    runs = np.diff(ends, prepend=0)
    ks = np.unique(np.concatenate((ends[np.argsort(-runs, kind="stable")[:CERTIFICATE_RUNS]],
                                   np.minimum(1 << np.arange(n.bit_length()), n))))
    t = sizes[ks - 1]
    ks, t = ks[t > 0], t[t > 0]
    slots = np.floor(room[None, :] / t[:, None]).sum(axis=1)
    return bool((ks > slots).any())


SHED_HEAP_PER_RANK = 4
"""Shed items are placed one by one through per-node heaps up to this many per rank; beyond (one rank
holding most of a skewed step), a vectorized chunked LPT places them node-blind -- most of them leave the
source node anyway, since a node holds only its share of the capacity."""


def _place_heap(costs, sources, shed, rank_load, limit, topology) -> np.ndarray | None:
    """Largest first: the least loaded rank of the item's node if it fits under ``limit``, else the least
    loaded rank anywhere. Per-node heaps and one global heap of (load, rank), lazily refreshed (loads only
    grow, so an entry is current iff its load equals the rank's)."""
    loads = rank_load.tolist()
    per_node = topology.ranks_per_node
    node_heaps = [[(loads[r], r) for r in range(n * per_node, min(len(loads), (n + 1) * per_node))]
                  for n in range(topology.num_nodes)]
    every = [(v, r) for r, v in enumerate(loads)]
    heapq.heapify(every)
    push, pop = heapq.heappush, heapq.heappop
    out = []
    for node, c in zip((sources[shed] // per_node).tolist(), costs[shed].tolist()):
        heap = node_heaps[node]
        v, r = heap[0]
        while v != loads[r]:  # the least loaded rank of the node (the loop inlined: one call less per item)
            pop(heap)
            v, r = heap[0]
        if v + c > limit:
            v, r = every[0]
            while v != loads[r]:
                pop(every)
                v, r = every[0]
            if v + c > limit:
                return None
        v = loads[r] = v + c
        out.append(r)
        push(node_heaps[r // per_node], (v, r))
        push(every, (v, r))
    return np.array(out, dtype=np.int64)


def _place_batched(costs, shed, rank_load, limit) -> np.ndarray | None:
    """Node-blind chunked LPT from the kept loads (NOTE [ Batched LPT ]); None if it breaks ``limit``."""
    num_ranks = rank_load.size
    load = rank_load.copy()
    chunk = max(1, -(-3 * num_ranks // 4))
    out = np.empty(shed.size, dtype=np.int64)
    sizes = costs[shed]
    for start in range(0, shed.size, chunk):
        k = min(chunk, shed.size - start)
        ranks = np.argsort(load, kind="stable")[:k]
        out[start:start + k] = ranks
        load[ranks] += sizes[start:start + k]
    return out if load.max() <= limit else None


def _place_capped(costs, weights, sources, shed, rank_load, used, limit, room, topology) -> np.ndarray | None:
    """With a cap on weights: the least loaded rank of the item's node that fits both, else of all ranks."""
    per_node = topology.ranks_per_node
    out = []
    for i in shed.tolist():
        c, w = costs[i], weights[i]
        lo = int(sources[i]) // per_node * per_node
        for a, b in ((lo, min(lo + per_node, rank_load.size)), (0, rank_load.size)):
            fits = np.flatnonzero((rank_load[a:b] + c <= limit) & (used[a:b] + w <= room))
            if fits.size:
                r = a + int(fits[np.argmin(rank_load[a:b][fits])])  # argmin: lowest rank on ties
                break
        else:
            return None
        out.append(r)
        rank_load[r] += c
        used[r] += w
    return np.array(out, dtype=np.int64)
