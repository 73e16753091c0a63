"""Rebalance one aligned step across ranks: the loader's ``balance=True`` policy, as a pure function.

After alignment every rank holds one group (or IDLE) for step ``s``; their costs differ. Moving samples
between the ranks' groups of that one step evens them out without changing the step count, and gives IDLE
ranks real work when another rank holds two or more samples.

NOTE [ Rebalancing a step keeps every budget ]
    Padded cost (``samples x longest``) is not additive, so a sum-based balancer could build an over-budget
    group. The padded path instead solves min-max exactly over contiguous runs of the length-sorted samples
    (NOTE [ Padded balancing is contiguous ] in `evenflow.balance.padded`). Its optimum ``T*`` is at
    most the largest input group's cost -- the input itself is one feasible solution -- and the input groups
    were within budget, so every output group is too. Runs are then split (never merged) until
    ``min(samples, ranks)`` groups are non-empty: a sub-run of a run costs no more. Example, budget 16,
    ranks hold [8, 8] | [3] | IDLE: T* = 8 ([8], [8], [3]) -- three non-empty groups of cost 8, 8, 3
    instead of 16, 3, 0. The summed path starts from the input, improves it with moves/swaps that keep every
    group under the budget, and keeps an LPT plan only if it is better.

Samples are opaque ids: the function sees lengths only, orders ties by (source rank, position), and returns
ids. Which rank gets which new group is an exact assignment that keeps the most tokens where they are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, TypeVar

import numpy as np

from .padded import padded_loads, padded_partition
from .planners import lpt, makespan, refine_swaps
from .matching import assign_buckets_greedy
from .topology import Topology

__all__ = ["rebalance_step", "step_costs"]

Id = TypeVar("Id", bound=Hashable)


def _round_up(lengths: np.ndarray, multiple: int | None) -> np.ndarray:
    if multiple is None or multiple == 1:
        return lengths
    return -(-lengths // multiple) * multiple


def step_costs(lengths_by_rank: Sequence[Sequence[int]], *, cost: Literal["padded", "summed"] = "padded",
               pad_to_multiple_of: int | None = None) -> list[int]:
    """Per rank, the cost of its group: ``samples x longest`` (padded) or ``round_up(sum)`` (summed).

    >>> step_costs([[3, 8], [5], []])
    [16, 5, 0]
    """
    out = []
    for ls in lengths_by_rank:
        arr = np.asarray(ls, dtype=np.int64)
        if arr.size == 0:
            out.append(0)
        elif cost == "padded":
            out.append(int(arr.size * _round_up(arr.max(keepdims=True), pad_to_multiple_of)[0]))
        else:
            out.append(int(_round_up(arr.sum(keepdims=True), pad_to_multiple_of)[0]))
    return out


def rebalance_step(groups_by_rank: Sequence[Sequence[Id]], lengths_by_rank: Sequence[Sequence[int]], *,
                   budget: int, cost: Literal["padded", "summed"] = "padded", pad_to_multiple_of: int | None = None,
                   tolerance: float = 0.02) -> list[list[Id]]:
    """Move samples between the ranks' groups of ONE step so that every rank's cost is close to the max's.

    ``groups_by_rank[r]``: the sample ids rank ``r`` trains at this step (``[]`` = IDLE);
    ``lengths_by_rank[r][j]``: the length of ``groups_by_rank[r][j]``. Returns new groups, one per rank, such
    that

    * every sample appears exactly once (ids are moved, never copied or dropped);
    * every group is within ``budget`` under ``cost`` (NOTE [ Rebalancing a step keeps every budget ]);
    * the max group cost never rises, and is optimal for ``cost="padded"``;
    * ``min(samples, ranks)`` groups are non-empty: an IDLE rank gets a sample whenever another rank holds two;
    * when the input is already within ``tolerance`` of the optimum and has no avoidable IDLE rank, it is
      returned unchanged (moving samples costs a transfer);
    * the result depends only on the lengths and their positions: the same on every rank.

    Within a group, samples keep the order (source rank, position in the source group).

    >>> rebalance_step([["a", "b"], ["c"], []], [[8, 8], [3], []], budget=16)
    [['a'], ['c'], ['b']]
    >>> rebalance_step([["a", "b", "c", "d"], ["e"]], [[5, 5, 4, 4], [2]], budget=20)
    [['a', 'b'], ['c', 'd', 'e']]
    """
    ids, lens = _flatten_step(groups_by_rank, lengths_by_rank, budget, cost, tolerance)
    world = len(groups_by_rank)
    before = step_costs(lengths_by_rank, cost=cost, pad_to_multiple_of=pad_to_multiple_of)
    over = [r for r, c in enumerate(before) if c > budget]
    if over:
        r = over[0]
        raise ValueError(f"rank {r}: its group already costs {before[r]} > budget={budget} ({cost} cost); "
                         "rebalance_step takes groups that respect the budget -- form them with the same budget")
    n = len(ids)
    if n == 0 or world == 1:
        return [list(g) for g in groups_by_rank]
    length = np.asarray(lens, dtype=np.int64)
    sources = np.repeat(np.arange(world), [len(g) for g in groups_by_rank])
    buckets, new_max = _balanced_buckets(length, sources, world, budget, cost, pad_to_multiple_of)
    nonempty_before = sum(1 for g in groups_by_rank if len(g))
    if nonempty_before >= min(n, world) and max(before) <= (1 + tolerance) * new_max:
        return [list(g) for g in groups_by_rank]
    # Buckets are interchangeable: give each rank the bucket that keeps the most of its own tokens (the sparse
    # greedy matching: no scipy on this per-step path; exact on the instances tests compare).
    rank_of_bucket = assign_buckets_greedy(buckets, sources, Topology(num_ranks=world, ranks_per_node=world),
                                           item_bytes=length)
    dest = rank_of_bucket[buckets]
    out: list[list[Id]] = [[] for _ in range(world)]
    for i in range(n):  # (source rank, position) order
        out[int(dest[i])].append(ids[i])
    after = step_costs(_split(lens, dest, world), cost=cost, pad_to_multiple_of=pad_to_multiple_of)
    assert max(after) <= budget and max(after) <= max(before), "rebalance_step broke a budget"  # the NOTE's proof
    return out


def _flatten_step(groups_by_rank, lengths_by_rank, budget: int, cost: str, tolerance: float) -> tuple[list, list[int]]:
    """Check the arguments and flatten the step to (ids, lengths) in (source rank, position) order."""
    if cost not in ("padded", "summed"):
        raise ValueError(f"cost must be 'padded' or 'summed', got {cost!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget <= 0:
        raise ValueError(f"budget must be a positive integer (tokens per group), got {budget!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1), got {tolerance!r}")
    world = len(groups_by_rank)
    if world == 0:
        raise ValueError("groups_by_rank is empty: pass one group (possibly []) per rank")
    if len(lengths_by_rank) != world:
        raise ValueError(f"lengths_by_rank has {len(lengths_by_rank)} ranks, groups_by_rank has {world}; pass one "
                         "list of lengths per rank, parallel to the groups")
    ids: list = []
    lens: list[int] = []
    for r, (group, ls) in enumerate(zip(groups_by_rank, lengths_by_rank)):
        if len(group) != len(ls):
            raise ValueError(f"rank {r}: {len(group)} samples but {len(ls)} lengths; lengths_by_rank[{r}] must "
                             "give one length per sample of groups_by_rank[{r}]")
        for j, length in enumerate(ls):
            if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length <= 0:
                raise ValueError(f"rank {r}, sample {j} ({group[j]!r}): length {length!r} is not a positive "
                                 "integer; lengths are token counts")
        ids.extend(group)
        lens.extend(int(v) for v in ls)
    return ids, lens


def _balanced_buckets(length: np.ndarray, sources: np.ndarray, world: int, budget: int, cost: str,
                      pad_to_multiple_of: int | None) -> tuple[np.ndarray, float]:
    """Buckets of the step's samples and their max cost: exact padded split, or the summed plan."""
    if cost == "padded":
        unit = _round_up(length, pad_to_multiple_of).astype(np.float64)
        buckets = padded_partition(unit, world)
        return buckets, float(padded_loads(unit, buckets, world).max())
    buckets = _summed_plan(length, sources, world, budget, pad_to_multiple_of)
    return buckets, float(max(step_costs(_split(length.tolist(), buckets, world), cost="summed",
                                         pad_to_multiple_of=pad_to_multiple_of)))


def _split(values: list[int], dest: np.ndarray, world: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(world)]
    for v, d in zip(values, dest.tolist()):
        out[d].append(v)
    return out


def _summed_plan(length: np.ndarray, sources: np.ndarray, world: int, budget: int,
                 pad_to_multiple_of: int | None) -> np.ndarray:
    """Summed cost: the better of (input refined under the budget) and (LPT under the budget), idle ranks filled."""
    cap = budget if not pad_to_multiple_of else (budget // pad_to_multiple_of) * pad_to_multiple_of
    costs = length.astype(np.float64)
    base = refine_swaps(costs, sources, world, cap=cap)
    plans = [base]
    try:
        plans.append(lpt(costs, world, cap=cap))
    except ValueError:
        pass  # greedy LPT found no room under the budget; the refined input is always feasible
    best = min(plans, key=lambda a: makespan(costs, a, world))  # ties: the refined input (fewer moves)
    return _fill_idle(costs, best, world)


def _fill_idle(costs: np.ndarray, assignment: np.ndarray, world: int) -> np.ndarray:
    """Give each empty rank the smallest sample of the costliest rank holding two or more."""
    out = assignment.copy()
    while True:
        counts = np.bincount(out, minlength=world)
        empty = np.flatnonzero(counts == 0)
        donors = np.flatnonzero(counts >= 2)
        if empty.size == 0 or donors.size == 0:
            return out
        rank_load = np.bincount(out, weights=costs, minlength=world)
        donor = int(donors[np.lexsort((donors, -rank_load[donors]))[0]])
        mine = np.flatnonzero(out == donor)
        i = int(mine[np.lexsort((mine, costs[mine]))[0]])
        out[i] = int(empty[0])
