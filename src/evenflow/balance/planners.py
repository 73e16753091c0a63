"""Balancing planners: give every item a rank so that the most loaded rank is as light as possible. Pure.

Every rank calls these on the same gathered metadata and must get the same plan, so every choice is a
function of the input only: items are ordered by ``(cost descending, index ascending)``, ranks by ``(load,
index)``, and iterative steps stop on counts, never on a clock.

======================  ===============================================  ===================================
planner                 guarantee                                        use
======================  ===============================================  ===================================
:func:`lpt`             LPT greedy <= 4/3 OPT, then swap refinement      default up to ``BATCHED_ABOVE`` items
:func:`lpt_batched`     LPT over chunks of ranks, vectorized; refined    2,560 ranks x 32 items in ~15 ms
:func:`karmarkar_karp`  largest differencing (multi-way)                 option; often tighter than LPT
:func:`milp_balance`    exact (HiGHS via ``scipy.optimize.milp``)        small instances, oracle in tests
``padded_partition``    exact for padded cost ``n * f(max L)``           right-padded batches (``padded.py``)
======================  ===============================================  ===================================

:func:`plan_balance` is the entry point: balanced buckets, then buckets mapped to ranks to move the fewest
bytes (:mod:`evenflow.balance.topology`), then locality (NOTE [ Locality ] in :mod:`evenflow.balance.locality`).

NOTE [ Batched LPT ]
    LPT takes the items largest first and gives each to the least loaded rank: one heap operation per item,
    ~80 ms for 81,920 items in Python. The batched variant takes the next ``m`` items (default ``m = 3/4`` of
    the ranks) and gives them, largest first, to the ``m`` least loaded ranks, least loaded first -- one
    vectorized step per chunk. With ``m = ranks`` every rank would get one item per chunk, so the rank
    holding the largest item would also get one of every later chunk (max/bound 1.3 on real request
    lengths); ``m < ranks`` lets heavily loaded ranks sit chunks out (1.002). Example, 4 ranks, m = 2, costs
    [9, 5, 4, 4, 3, 3, 2, 2]: chunk [9, 5] -> ranks 0, 1; chunk [4, 4] -> ranks 2, 3 (loads 9, 5, 4, 4);
    chunk [3, 3] -> ranks 2, 3 (9, 5, 7, 7); chunk [2, 2] -> ranks 1, 2 (9, 7, 9, 7). Max 9 = the largest
    item, optimal.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .costs import as_costs
from .locality import locality_plan
from .topology import Topology, assign_buckets, transfer_bytes

__all__ = [
    "BalanceConfig", "Method", "BATCHED_ABOVE", "loads", "makespan", "lower_bound", "lpt", "lpt_batched",
    "karmarkar_karp", "milp_balance", "refine_swaps", "refine_pairs", "balance", "plan_balance",
]

Method = Literal["auto", "lpt", "lpt_batched", "kk", "milp"]

BATCHED_ABOVE = 16_384
"""``method="auto"`` uses heap LPT up to this many items and :func:`lpt_batched` above (NOTE [ Batched LPT ])."""
KK_MAX_CELLS = 4_000_000
"""Karmarkar-Karp keeps one ``num_ranks``-wide partial partition per item: refuse beyond this many cells."""
MILP_MAX_CELLS = 20_000
"""``milp_balance`` has ``items x ranks`` binaries; beyond this HiGHS may not finish in a step."""
PAIR_ROUNDS = 4
"""Rounds of pairwise refinement after :func:`lpt_batched` (a count, not a clock, so every rank stops alike)."""
PAIR_COUNT = 32
"""Most loaded ranks paired with the least loaded ones in each round of pairwise refinement."""


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How :func:`plan_balance` balances. Every field is checked in ``__post_init__``."""

    method: Method = "auto"
    """``"auto"`` (heap LPT up to ``BATCHED_ABOVE`` items, batched LPT above), ``"lpt"``, ``"lpt_batched"``,
    ``"kk"`` (Karmarkar-Karp) or ``"milp"`` (exact, small instances)."""
    refine: bool = True
    """Run swap refinement after the greedy planners (never makes the max load worse)."""
    locality_tolerance: float | None = 0.02
    """Keep items on their source rank when that raises the max load by at most this fraction of the
    balanced plan's (NOTE [ Locality ]). ``None`` turns locality off: buckets are only mapped to ranks."""
    equal_counts: bool = False
    """Every rank gets ``n // R`` or ``n // R + 1`` items (e.g. when the items are groups and every rank must
    run the same number of micro-steps). Locality is skipped under this constraint."""
    node_assignment: bool = True
    """Map balanced buckets to ranks by the exact assignment on bytes moved (:mod:`evenflow.balance.topology`).
    ``False`` places bucket ``b`` on rank ``b``: at thousands of ranks the assignment costs ~1 s of CPU."""
    milp_time_limit: float = 10.0
    """Seconds HiGHS may spend in ``method="milp"``; the best solution found is used after that."""

    def __post_init__(self) -> None:
        if self.method not in ("auto", "lpt", "lpt_batched", "kk", "milp"):
            raise ValueError(f"method must be 'auto', 'lpt', 'lpt_batched', 'kk' or 'milp', got {self.method!r}")
        if self.locality_tolerance is not None and not (
                isinstance(self.locality_tolerance, (int, float)) and 0 <= self.locality_tolerance < 1):
            raise ValueError(f"locality_tolerance must be a fraction in [0, 1) or None (off), got "
                             f"{self.locality_tolerance!r}")
        if not (isinstance(self.milp_time_limit, (int, float)) and self.milp_time_limit > 0):
            raise ValueError(f"milp_time_limit must be > 0 seconds, got {self.milp_time_limit!r}")


# -- helpers -------------------------------------------------------------------------------------------------

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


def _cap_weights(costs: np.ndarray, cap: float | None, cap_weights: Sequence[float] | np.ndarray | None) -> np.ndarray | None:
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


# -- LPT -----------------------------------------------------------------------------------------------------

def lpt(costs: Sequence[float] | np.ndarray, num_ranks: int, *, cap: float | None = None,
        cap_weights: Sequence[float] | np.ndarray | None = None, equal_counts: bool = False,
        refine: bool = True) -> np.ndarray:
    """Longest processing time first, then :func:`refine_swaps`. Returns the rank of each item.

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
    n = arr.size
    out = np.empty(n, dtype=np.int64)
    order = _order_desc(arr).tolist()
    if weights is None or cap_weights is None:
        # Heap of (load, rank): the least loaded rank, lowest index on ties. With cap on the costs themselves,
        # the least loaded rank is the only one that can fit an item if any can.
        q, extra = _equal_quota(n, num_ranks)
        counts = [0] * num_ranks
        heap = [(0.0, r) for r in range(num_ranks)]
        at_extra = 0
        for i in order:
            while True:
                if not heap:  # pragma: no cover - quota sums to n
                    raise AssertionError("equal_counts quota exhausted")
                load, r = heap[0]
                full = equal_counts and (counts[r] > q or (counts[r] == q and at_extra >= extra))
                if not full:
                    break
                heapq.heappop(heap)  # a full rank never takes another item
            if weights is not None and load + arr[i] > cap:
                raise ValueError(_no_room(i, arr[i], cap, "lpt"))
            out[i] = r
            counts[r] += 1
            if equal_counts and counts[r] == q + 1:
                at_extra += 1
            heapq.heapreplace(heap, (load + float(arr[i]), r))
    else:
        load = np.zeros(num_ranks)
        used = np.zeros(num_ranks)
        counts_arr = np.zeros(num_ranks, dtype=np.int64)
        q, extra = _equal_quota(n, num_ranks)
        for i in order:
            ok = used + weights[i] <= cap
            if equal_counts:
                at_extra = int((counts_arr > q).sum())
                ok &= (counts_arr < q) | ((counts_arr == q) & (at_extra < extra))
            if not ok.any():
                raise ValueError(_no_room(i, weights[i], cap, "lpt"))
            r = int(np.flatnonzero(ok)[np.argmin(load[ok])])
            out[i] = r
            load[r] += arr[i]
            used[r] += weights[i]
            counts_arr[r] += 1
    if refine and n:
        out = refine_swaps(arr, out, num_ranks, cap=cap, cap_weights=weights if cap is not None else None,
                           allow_moves=not equal_counts)
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
    ``max_steps`` (default ``4 * items``) bounds it by a count. Moves are off with ``allow_moves=False``
    (keeps item counts). Each step costs O(items on ``a`` x all items): for very large instances
    :func:`lpt_batched` uses a pairwise vectorized variant instead.

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
    max_steps = 4 * n if max_steps is None else max_steps
    rank_load = loads(arr, out, num_ranks)
    used = None if weights is None else loads(weights, out, num_ranks)
    for _ in range(max_steps):
        a = int(np.argmax(rank_load))
        top = rank_load[a]
        mine = np.flatnonzero(out == a)
        others = np.flatnonzero(out != a)
        cand_ranks = np.arange(num_ranks)
        if mine.size == 0:
            break
        best_val, best = top, None
        ca = arr[mine]
        if allow_moves:
            # Move item i of a to rank b: new pair max = max(top - c_i, load_b + c_i).
            lb = rank_load[cand_ranks]
            val = np.maximum(top - ca[:, None], lb[None, :] + ca[:, None])
            ok = (ca[:, None] > 0) & (cand_ranks[None, :] != a)
            if used is not None:
                ok &= used[cand_ranks][None, :] + weights[mine][:, None] <= cap
            val = np.where(ok, val, np.inf)
            flat = int(np.argmin(val))
            if val.flat[flat] < best_val:
                best_val = float(val.flat[flat])
                best = ("move", int(mine[flat // lb.size]), int(cand_ranks[flat % lb.size]))
        if others.size:
            d = ca[:, None] - arr[others][None, :]
            lb = rank_load[out[others]]
            val = np.maximum(top - d, lb[None, :] + d)
            ok = d > 0
            if used is not None:
                dw = weights[mine][:, None] - weights[others][None, :]
                ok &= (used[out[others]][None, :] + dw <= cap) & (used[a] - dw <= cap)
            val = np.where(ok, val, np.inf)
            flat = int(np.argmin(val))
            if val.flat[flat] < best_val:
                best_val = float(val.flat[flat])
                best = ("swap", int(mine[flat // others.size]), int(others[flat % others.size]))
        if best is None:
            break
        if best[0] == "move":
            _, i, b = best
            _relocate(out, rank_load, used, arr, weights, i, b)
        else:
            _, i, j = best
            b = int(out[j])
            _relocate(out, rank_load, used, arr, weights, i, b)
            _relocate(out, rank_load, used, arr, weights, j, a)
    return out


def _relocate(out: np.ndarray, rank_load: np.ndarray, used: np.ndarray | None, arr: np.ndarray,
              weights: np.ndarray | None, i: int, b: int) -> None:
    a = int(out[i])
    out[i] = b
    rank_load[a] -= arr[i]
    rank_load[b] += arr[i]
    if used is not None:
        used[a] -= weights[i]
        used[b] += weights[i]


def _least_loaded(rank_load: np.ndarray, k: int) -> np.ndarray:
    """The k least loaded ranks, ordered by (load, index) -- exactly, ties included, without a full sort."""
    num_ranks = rank_load.size
    if 8 * k >= num_ranks:  # a stable full sort is (load, index) order and beats partition + lexsort here
        return np.argsort(rank_load, kind="stable")[:k]
    kth = np.partition(rank_load, k - 1)[k - 1]
    below = np.flatnonzero(rank_load < kth)
    tied = np.flatnonzero(rank_load == kth)[: k - below.size]
    chosen = np.concatenate((below, tied))
    return chosen[np.lexsort((chosen, rank_load[chosen]))]


def lpt_batched(costs: Sequence[float] | np.ndarray, num_ranks: int, *, chunk: int | None = None,
                equal_counts: bool = False, refine: bool = True) -> np.ndarray:
    """LPT over chunks of items, vectorized (NOTE [ Batched LPT ]), then a bounded swap refinement.

    ``chunk`` defaults to ``ceil(3 * num_ranks / 4)``; ``equal_counts`` forces ``chunk = num_ranks`` (one item per
    rank per chunk, so counts differ by at most one) and swap-only refinement.

    >>> lpt_batched([9, 5, 4, 4, 3, 3, 2, 2], 4, chunk=2, refine=False).tolist()
    [0, 1, 2, 3, 2, 3, 1, 2]
    """
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    n = arr.size
    if chunk is None:
        chunk = num_ranks if equal_counts else max(1, -(-3 * num_ranks // 4))
    if equal_counts:
        chunk = num_ranks
    if not (isinstance(chunk, (int, np.integer)) and 1 <= chunk <= num_ranks):
        raise ValueError(f"chunk must be an integer in [1, num_ranks={num_ranks}], got {chunk!r}")
    order = _order_desc(arr)
    sorted_costs = arr[order]
    rank_load = np.zeros(num_ranks)
    # slots[r, j]: the j-th item given to rank r (a chunk gives a rank at most one item), -1 = empty.
    slots = np.full((num_ranks, -(-n // chunk) if n else 0), -1, dtype=np.int64)
    counts = np.zeros(num_ranks, dtype=np.int64)
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        ranks = _least_loaded(rank_load, k)
        slots[ranks, counts[ranks]] = order[start:start + k]
        counts[ranks] += 1
        rank_load[ranks] += sorted_costs[start:start + k]
    slots = slots[:, :int(counts.max(initial=0))]
    if refine and n and num_ranks > 1:
        slots = _refine_table(arr, slots, allow_moves=not equal_counts)
    return _table_to_assignment(slots, n)


def _table_to_assignment(slots: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    filled = slots >= 0
    out[slots[filled]] = np.nonzero(filled)[0]
    return out


def refine_pairs(costs: np.ndarray, assignment: np.ndarray, num_ranks: int, *, allow_moves: bool = True,
                 rounds: int = PAIR_ROUNDS, pairs: int = PAIR_COUNT) -> np.ndarray:
    """Vectorized refinement: pair the ``pairs`` most loaded ranks with the least loaded, best swap per pair.

    Ranks' items live in a padded ``[ranks, width]`` table; empty slots are items of cost 0, so "swap item i
    of the heavy rank with an empty slot of the light rank" is a move (disabled by ``allow_moves=False``).
    For each pair with gap ``g = load_heavy - load_light`` the exchange ``d = c_i - c_j`` minimizing
    ``max(load_heavy - d, load_light + d)`` with ``0 < d < g`` is applied; pairs are disjoint, so all are
    applied at once. Never raises the max load.
    """
    arr = as_costs(costs)
    assignment = np.asarray(assignment, dtype=np.int64)
    n = arr.size
    order = np.argsort(assignment, kind="stable")
    counts = np.bincount(assignment, minlength=num_ranks)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    col = np.arange(n) - np.repeat(starts, counts)
    slots = np.full((num_ranks, int(counts.max(initial=0))), -1, dtype=np.int64)
    slots[assignment[order], col] = order
    if n and num_ranks > 1:
        slots = _refine_table(arr, slots, allow_moves=allow_moves, rounds=rounds, pairs=pairs)
    return _table_to_assignment(slots, n)


def _refine_table(costs: np.ndarray, slots: np.ndarray, *, allow_moves: bool, rounds: int = PAIR_ROUNDS,
                  pairs: int = PAIR_COUNT) -> np.ndarray:
    num_ranks = slots.shape[0]
    if allow_moves:  # room for up to `rounds` received items per rank
        slots = np.concatenate((slots, np.full((num_ranks, rounds), -1, dtype=np.int64)), axis=1)
    width = slots.shape[1]
    value = np.where(slots >= 0, costs[np.maximum(slots, 0)], 0.0)
    rank_load = value.sum(axis=1)
    k = min(pairs, num_ranks // 2)
    ranks = np.arange(num_ranks)
    rows = np.arange(k)
    floor = max(float(costs.max(initial=0.0)), float(costs.sum()) / num_ranks)  # no plan beats this
    for _ in range(rounds):
        if rank_load.max() <= floor * (1 + 1e-12):
            break
        by_load = np.lexsort((ranks, -rank_load))
        heavy, light = by_load[:k], by_load[::-1][:k]
        gap = rank_load[heavy] - rank_load[light]
        d = value[heavy][:, :, None] - value[light][:, None, :]  # [k, w, w]
        ok = (slots[heavy] >= 0)[:, :, None] & (d > 0) & (d < gap[:, None, None])
        if not allow_moves:
            ok &= (slots[light] >= 0)[:, None, :]
        score = np.where(ok, np.abs(gap[:, None, None] - 2 * d), np.inf).reshape(k, -1)
        best = np.argmin(score, axis=1)
        take = np.isfinite(score[rows, best])
        if not take.any():
            break
        h, l_, flat = heavy[take], light[take], best[take]
        i, j = flat // width, flat % width
        delta = d.reshape(k, -1)[take, flat]
        slots[h, i], slots[l_, j] = slots[l_, j], slots[h, i].copy()
        value[h, i], value[l_, j] = value[l_, j], value[h, i].copy()
        rank_load[h] -= delta
        rank_load[l_] += delta
    return slots


# -- Karmarkar-Karp --------------------------------------------------------------------------------------------

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
    _, _, _, subsets = heap[0]
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


# -- exact MILP ----------------------------------------------------------------------------------------------

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
    from scipy.sparse import coo_array

    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    weights = _cap_weights(arr, cap, cap_weights)
    n = arr.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if n * num_ranks > MILP_MAX_CELLS:
        raise ValueError(f"milp_balance would have {n} x {num_ranks} binaries (> {MILP_MAX_CELLS}); use "
                         "method='lpt' or 'kk' for instances this large")
    nv = n * num_ranks + 1  # x[i, r] at i * R + r, then t
    t_col = nv - 1
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []
    row = 0

    def add(r_cols: np.ndarray, r_vals: np.ndarray, lower: float, upper: float) -> None:
        nonlocal row
        rows.append(np.full(r_cols.size, row))
        cols.append(r_cols)
        vals.append(r_vals)
        lo.append(lower)
        hi.append(upper)
        row += 1

    items = np.arange(n)
    for i in range(n):
        add(i * num_ranks + np.arange(num_ranks), np.ones(num_ranks), 1.0, 1.0)
    for r in range(num_ranks):
        add(np.append(items * num_ranks + r, t_col), np.append(arr, -1.0), -np.inf, 0.0)
        if weights is not None:
            add(items * num_ranks + r, weights, -np.inf, float(cap))
        if equal_counts:
            q, extra = _equal_quota(n, num_ranks)
            add(items * num_ranks + r, np.ones(n), float(q), float(q + (1 if extra else 0)))
        if r + 1 < num_ranks:
            add(np.concatenate((items * num_ranks + r, items * num_ranks + r + 1)), np.concatenate((arr, -arr)),
                0.0, np.inf)
    matrix = coo_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, nv))
    objective = np.zeros(nv)
    objective[t_col] = 1.0
    integrality = np.ones(nv)
    integrality[t_col] = 0
    upper = np.ones(nv)
    upper[t_col] = np.inf
    result = milp(objective, constraints=LinearConstraint(matrix.tocsr(), lo, hi), integrality=integrality,
                  bounds=Bounds(np.zeros(nv), upper),
                  options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "disp": False})
    if result.x is None:
        if result.status == 2:
            raise ValueError(f"no assignment of {n} items to {num_ranks} ranks satisfies cap={cap} and "
                             f"equal_counts={equal_counts}; raise cap or add ranks")
        raise ValueError(f"milp_balance found no solution within time_limit={time_limit}s ({result.message}); "
                         "raise time_limit or use method='lpt'")
    x = result.x[:t_col].reshape(n, num_ranks)
    return np.argmax(x, axis=1).astype(np.int64)


# -- dispatch and the entry point ----------------------------------------------------------------------------

def balance(costs: Sequence[float] | np.ndarray, num_ranks: int, *, config: BalanceConfig = BalanceConfig(),
            cap: float | None = None, cap_weights: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """Balanced buckets ``0..num_ranks-1`` (one per item) by ``config.method``; no locality, no topology."""
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    method = config.method
    if method == "auto":
        method = "lpt" if (arr.size <= BATCHED_ABOVE or cap is not None) else "lpt_batched"
    if method in ("lpt_batched", "kk") and cap is not None:
        raise ValueError(f"method={method!r} does not support cap; use method='lpt' or 'milp' with a cap")
    if method == "lpt":
        return lpt(arr, num_ranks, cap=cap, cap_weights=cap_weights, equal_counts=config.equal_counts,
                   refine=config.refine)
    if method == "lpt_batched":
        return lpt_batched(arr, num_ranks, equal_counts=config.equal_counts, refine=config.refine)
    if method == "kk":
        if config.equal_counts:
            raise ValueError("method='kk' does not support equal_counts; use method='lpt' or 'milp'")
        out = karmarkar_karp(arr, num_ranks)
        return refine_swaps(arr, out, num_ranks) if config.refine else out
    return milp_balance(arr, num_ranks, cap=cap, cap_weights=cap_weights, equal_counts=config.equal_counts,
                        time_limit=config.milp_time_limit)


def _as_sources(sources: Sequence[int] | np.ndarray, n: int, num_ranks: int) -> np.ndarray:
    arr = np.asarray(sources)
    if arr.shape != (n,):
        raise ValueError(f"sources has shape {arr.shape}, expected ({n},): one source rank per item")
    if n and not np.issubdtype(arr.dtype, np.integer):
        bad = next((i for i, v in enumerate(arr.tolist()) if not float(v).is_integer()), None) \
            if np.issubdtype(arr.dtype, np.number) else 0
        if bad is not None:
            raise ValueError(f"item {bad}: source {arr[bad].item()!r} is not an integer rank; pass the rank that "
                             "holds the item")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= num_ranks))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"item {i}: source rank {int(arr[i])} is outside [0, {num_ranks}); pass the rank that "
                         "holds the item, or the right num_ranks")
    return arr


def _as_bytes(item_bytes: Sequence[float] | np.ndarray | None, costs: np.ndarray) -> np.ndarray:
    if item_bytes is None:
        return costs
    arr = as_costs(item_bytes, what="item")
    if arr.shape != costs.shape:
        raise ValueError(f"item_bytes has {arr.size} entries for {costs.size} items; pass one per item")
    return arr


def plan_balance(costs: Sequence[float] | np.ndarray, sources: Sequence[int] | np.ndarray, num_ranks: int, *,
                 ranks_per_node: int | None = None, item_bytes: Sequence[float] | np.ndarray | None = None,
                 cap: float | None = None, cap_weights: Sequence[float] | np.ndarray | None = None,
                 config: BalanceConfig = BalanceConfig()) -> list[int]:
    """Destination rank of every item: balanced, then as little data moved as possible. Pure, deterministic.

    1. Balanced buckets (``config.method``; LPT + swaps by default) -- the max load ``M``.
    2. Buckets are interchangeable: map them to ranks by a linear assignment that minimizes inter-node
       bytes, then intra-node bytes (:func:`evenflow.balance.topology.assign_buckets`).
    3. Locality (default 2 %): a plan that keeps items home with max load <= ``(1 + tol) * M`` replaces it
       when it moves fewer bytes (NOTE [ Locality ]).

    ``costs[i]``: the item's cost (additive: use :func:`~evenflow.balance.padded.padded_partition` for padded
    batches);
    ``sources[i]``: the rank that holds it now; ``ranks_per_node``: ranks per node, consecutive (``None``:
    one node); ``item_bytes``: bytes moved if the item moves (default: its cost); ``cap``: limit on each
    rank's sum of ``cap_weights`` (default: of the costs).

    >>> plan_balance([4, 4, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], 2)
    [0, 1, 0, 0, 1, 1]
    """
    arr = as_costs(costs)
    num_ranks = _check_ranks(num_ranks)
    n = arr.size
    src = _as_sources(sources, n, num_ranks)
    nbytes = _as_bytes(item_bytes, arr)
    weights = _cap_weights(arr, cap, cap_weights)
    topology = Topology(num_ranks=num_ranks, ranks_per_node=num_ranks if ranks_per_node is None else ranks_per_node)
    if n == 0:
        return []
    buckets = balance(arr, num_ranks, config=config, cap=cap, cap_weights=weights if cap is not None else None)
    dest = assign_buckets(buckets, src, topology, item_bytes=nbytes)[buckets] if config.node_assignment else buckets
    tol = config.locality_tolerance
    if tol is not None and not config.equal_counts:
        limit = makespan(arr, dest, num_ranks) * (1 + tol)
        home = locality_plan(arr, src, num_ranks, limit, topology, item_bytes=nbytes, cap=cap,
                             cap_weights=weights if cap_weights is not None else None)
        if home is not None and transfer_bytes(home, src, nbytes, topology) < transfer_bytes(dest, src, nbytes,
                                                                                            topology):
            dest = home
    return dest.tolist()
