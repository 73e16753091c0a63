"""Step 1 of the global round plan ([`evenflow.planning.pooled.plan`][evenflow.planning.pooled.plan]): groups over the
union of every rank's buffer, and the drain's re-grouping of the last items into as many cheap groups as there are
slots. Pure.

Groups are slices of one sorted order ([`_Table`][_Table]); the plan's later steps choose, deal and place them.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..grouping import GroupingConfig, padded_length, plan

__all__ = ["global_groups"]

# -- 1. groups over the union ----------------------------------------------------------------------------------

RADIX_LIMIT = 1 << 16
"""Padded lengths and ranks below this sort as uint16, where numpy's stable sort is a radix sort (O(n):
4.5 ms instead of 19 ms for 262,144 items)."""


@dataclass(frozen=True)
class _Table:
    """Groups as slices of one sorted order: group k is ``order[lo[k]:hi[k]]``, costliest length first."""

    order: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    def __len__(self) -> int:
        return int(self.lo.size)

    def group(self, k: int) -> np.ndarray:
        return self.order[self.lo[k]:self.hi[k]]


def _sort_key_order(plen: np.ndarray, sources: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``keep`` sorted by (padded length, source, id), by radix passes when the values allow."""
    everything = keep.size == plen.size  # no oversize item: skip the gathers
    p, s = (plen, sources) if everything else (plen[keep], sources[keep])
    if p.size and p.max() < RADIX_LIMIT and s.max() < RADIX_LIMIT:
        order = np.arange(keep.size)
        if np.any(s[1:] < s[:-1]):  # rank-major input (the runtime's) is already in source order
            order = np.argsort(s.astype(np.uint16), kind="stable")
        order = order[np.argsort(p[order].astype(np.uint16), kind="stable")]
        return order if everything else keep[order]
    return keep[np.lexsort((keep, s, p))]


def _oversize(lengths, plen, sources, extra, grouping: GroupingConfig) -> np.ndarray:
    over = plen > grouping.token_budget
    for name, cap in grouping.extra_budgets.items():
        over |= extra[name] > cap
    if over.any() and grouping.oversize != "alone":
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"item {i} (source rank {int(sources[i])}): length {int(lengths[i])} or an extra resource "
                         f"exceeds its budget (token_budget={grouping.token_budget}); the loader should have "
                         "refused it when buffering -- set oversize='alone' or raise the budget")
    return over


def _banded(plen: np.ndarray, tolerance: float) -> np.ndarray:
    """Planning length for keep-home grouping: the longest padded length of the item's band, bands being
    ``[(1 + tol)^k, (1 + tol)^(k + 1))``. Within a band every item plans as its longest, so the greedy cut
    -- and the budget check -- hold for any order inside the band (NOTE [ Keep-home tolerance ])."""
    order = np.argsort(plen, kind="stable")
    sp = plen[order]
    band = np.floor(np.log(sp) / np.log1p(tolerance)).astype(np.int64)
    last = np.flatnonzero(np.concatenate((band[1:] != band[:-1], [True]))) if sp.size else np.zeros(0, np.int64)
    out = np.empty_like(plen)
    out[order] = np.repeat(sp[last], np.diff(np.concatenate(([-1], last))))
    return out


def _group_table(lengths: np.ndarray, sources: np.ndarray, grouping: GroupingConfig,
                 extra: Mapping[str, np.ndarray], keep_home: float | None = None) -> _Table:
    if grouping.cost != "padded":
        groups = plan(lengths, grouping, extra=dict(extra)).groups
        sizes = np.array([len(g) for g in groups], dtype=np.int64)
        hi = np.cumsum(sizes)
        order = np.fromiter((i for g in groups for i in g), np.int64, count=int(sizes.sum()))
        return _Table(order, hi - sizes, hi)
    plen = padded_length(lengths, grouping.pad_to_multiple_of)
    over = _oversize(lengths, plen, sources, extra, grouping)
    if keep_home and not over.any():
        plen = _banded(plen, keep_home)
    elif keep_home:
        plen = plen.copy()
        plen[~over] = _banded(plen[~over], keep_home)
    order = _sort_key_order(plen, sources, np.flatnonzero(~over))
    bounds = np.array(_greedy_bounds(plen[order], {k: extra[k][order] for k in grouping.extra_budgets}, grouping),
                      dtype=np.int64)
    alone = np.flatnonzero(over)
    m = order.size
    return _Table(np.concatenate((order, alone)), np.concatenate((bounds[1:], m + np.arange(alone.size))),
                  np.concatenate((bounds[:-1], m + 1 + np.arange(alone.size))))


def global_groups(lengths: np.ndarray, sources: np.ndarray, grouping: GroupingConfig,
                  extra: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Groups of item ids under ``grouping``, the costliest-length group first.

    Padded cost: sort by (padded length, source, id) and cut greedily from the top (the optimal contiguous
    partition, NOTE [ Padded grouping is optimal ]); a sample over budget on its own gets its own group under
    ``oversize="alone"`` and raises otherwise (the runtime already applied ``"drop"`` when buffering). Summed
    cost: [`evenflow.planning.grouping.plan()`][evenflow.planning.grouping.plan] on the union.

    >>> [g.tolist() for g in global_groups(np.array([3, 3, 3, 3]), np.array([1, 0, 1, 0]),
    ...                                     GroupingConfig(token_budget=6))]
    [[0, 2], [1, 3]]
    """
    table = _group_table(np.asarray(lengths, dtype=np.int64), np.asarray(sources, dtype=np.int64), grouping,
                         dict(extra or {}))
    return [table.group(k) for k in range(len(table))]


def _greedy_bounds(sorted_plen: np.ndarray, sorted_extra: Mapping[str, np.ndarray],
                   grouping: GroupingConfig) -> list[int]:
    """Cut points ``[n, ..., 0]``: group k is ``order[bounds[k + 1]:bounds[k]]``.

    A group's size depends only on its top (longest) item and the extra budgets' sums, so without extra
    budgets every group whose top lies in a run of equal padded lengths ``L`` takes ``q = budget // L``
    items: one arithmetic progression per run instead of one step per group (19,000 groups -> a few
    thousand runs for 262,144 chat samples).
    """
    top = int(sorted_plen.size)
    budget, most = grouping.token_budget, grouping.max_samples or max(top, 1)
    if grouping.extra_budgets:
        return _greedy_bounds_extra(sorted_plen, sorted_extra, grouping)
    starts = (np.flatnonzero(np.concatenate(([True], sorted_plen[1:] != sorted_plen[:-1]))) if top
              else np.zeros(0, np.int64))
    bounds = [top]
    for a, length in zip(starts[::-1].tolist(), sorted_plen[starts[::-1]].tolist()):
        if top <= a:  # the last group reached below this run: its top is in a lower run
            continue
        q = min(budget // length, most)
        k = -(-(top - a) // q)
        bounds.extend(range(top - q, top - k * q - 1, -q))
        top = bounds[-1] = max(bounds[-1], 0)
    return bounds


def _greedy_bounds_extra(sorted_plen: np.ndarray, sorted_extra: Mapping[str, np.ndarray],
                         grouping: GroupingConfig) -> list[int]:
    """[`_greedy_bounds()`][_greedy_bounds] with extra budgets: one step per group, each bounded by prefix sums."""
    top = int(sorted_plen.size)
    read = sorted_plen.item
    budget, most = grouping.token_budget, grouping.max_samples or max(top, 1)
    prefixes = [(np.concatenate(([0], np.cumsum(sorted_extra[name]))).tolist(), cap)
                for name, cap in grouping.extra_budgets.items()]
    bounds = [top]
    while top > 0:
        take = min(top, budget // read(top - 1), most)
        for prefix, cap in prefixes:  # largest k with prefix[top] - prefix[top - k] <= cap
            take = min(take, top - bisect.bisect_left(prefix, prefix[top] - cap))
        top -= take
        bounds.append(top)
    return bounds


# -- the drain ---------------------------------------------------------------------------------------------------

BUDGET_SEARCH_STEPS = 24
"""Bisection steps of the drain's budget search: a count, not a clock (2**24 > any token budget's range)."""


def _drain_groups(lengths, sources, ext, grouping: GroupingConfig, table: _Table, slots: int,
                  keep_home: float | None) -> list[np.ndarray]:
    """All items in as many groups as ``slots`` allows, each as cheap as possible (NOTE [ Drain sized from the
    remaining work ])."""
    best = table
    if grouping.cost == "padded" and len(table) < slots:
        lo = int(padded_length(lengths, grouping.pad_to_multiple_of).max())
        hi = grouping.token_budget  # invariant: the plan under hi has <= slots groups
        for _ in range(BUDGET_SEARCH_STEPS):
            if lo >= hi:
                break
            mid = (lo + hi) // 2
            trial = _group_table(lengths, sources, _with_budget(grouping, mid), ext, keep_home)
            if len(trial) <= slots:
                hi, best = mid, trial
            else:
                lo = mid + 1
    return _split_to([best.group(k) for k in range(len(best))], lengths, grouping, slots)


def _with_budget(grouping: GroupingConfig, budget: int) -> GroupingConfig:
    return GroupingConfig(token_budget=budget, cost=grouping.cost, max_samples=grouping.max_samples,
                          extra_budgets=grouping.extra_budgets, oversize="alone",
                          pad_to_multiple_of=grouping.pad_to_multiple_of
                          if grouping.pad_to_multiple_of is None or grouping.pad_to_multiple_of <= budget else None)


def _split_to(groups: list[np.ndarray], lengths: np.ndarray, grouping: GroupingConfig,
              slots: int) -> list[np.ndarray]:
    """Split the costliest group (>= 2 items) at its best cut until there are ``slots`` groups or none splits.

    A heap of (-cost, group id): ids only grow, so ties break by age of the group, the same on every rank.
    """
    groups = list(groups)
    heap = [(-_token_cost(lengths[g], grouping), k) for k, g in enumerate(groups) if len(g) >= 2]
    heapq.heapify(heap)
    alive = len(groups)
    while alive < slots and heap:
        _, k = heapq.heappop(heap)
        g = groups[k]
        g = g[np.lexsort((g, lengths[g]))]
        cut = _best_cut(padded_length(lengths[g], grouping.pad_to_multiple_of), grouping.cost)
        groups[k] = g[cut:]
        groups.append(g[:cut])
        for part_id in (k, len(groups) - 1):
            if len(groups[part_id]) >= 2:
                heapq.heappush(heap, (-_token_cost(lengths[groups[part_id]], grouping), part_id))
        alive += 1
    return groups


def _token_cost(ls: np.ndarray, grouping: GroupingConfig) -> int:
    pl = padded_length(ls, grouping.pad_to_multiple_of)
    return int(pl.size * pl.max()) if grouping.cost == "padded" else int(ls.sum())


def _best_cut(sorted_plen: np.ndarray, cost: str) -> int:
    """Cut k (1 <= k < m) of an ascending run minimizing the larger half's cost."""
    m = sorted_plen.size
    k = np.arange(1, m)
    if cost == "padded":
        low, high = k * sorted_plen[k - 1], (m - k) * sorted_plen[-1]
    else:
        csum = np.cumsum(sorted_plen)
        low, high = csum[k - 1], csum[-1] - csum[k - 1]
    return int(k[np.argmin(np.maximum(low, high))])
