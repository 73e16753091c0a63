"""Balancing planners: give every item a rank so that the most loaded rank is as light as possible. Pure.

Every rank calls these on the same gathered metadata and must get the same plan, so every choice is a
function of the input only: items are ordered by ``(cost descending, index ascending)``, ranks by ``(load,
index)``, and iterative steps stop on counts, never on a clock.

======================  ===============================================  ===================================
planner                 guarantee                                        use
======================  ===============================================  ===================================
[`lpt()`][lpt]             LPT greedy <= 4/3 OPT, then swap refinement      default up to ``BATCHED_ABOVE`` items
[`lpt_batched()`][lpt_batched]     LPT over chunks of ranks, vectorized; refined    2,560 ranks x 32 items
[`karmarkar_karp()`][karmarkar_karp]  largest differencing (multi-way)                 option; often tighter than LPT
[`milp_balance()`][milp_balance]    exact (HiGHS via ``scipy.optimize.milp``)        small instances, oracle in tests
``padded_partition``    exact for padded cost ``n * f(max L)``           right-padded batches (``padded.py``)
======================  ===============================================  ===================================

[`plan_balance()`][plan_balance] is the entry point: balanced buckets, then buckets mapped to ranks to move the fewest
bytes (`evenflow.balance.matching`, or the exact [`evenflow.balance.topology`][evenflow.balance.topology] assignment),
then locality (NOTE [ Locality ] in `evenflow.balance.locality`). The planners live in small modules --
``lpt.py``, ``batched.py``, ``kk.py``, ``milp.py`` -- re-exported here.

NOTE [ No stall on the first step ]
    The default path (LPT or batched LPT, greedy matching, locality) is numpy only: no scipy import, which
    cost ~1.8 s on the first call when the assignment was scipy's. [`warm_up()`][warm_up] runs one tiny plan so
    numpy's own first-call costs are paid at construction, not inside the training loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .basics import _cap_weights, _check_ranks, _equal_quota, _order_desc, loads, lower_bound, makespan
from .batched import PAIR_COUNT, PAIR_ROUNDS, lpt_batched, refine_pairs
from .config import BATCHED_ABOVE, BalanceConfig, Method
from .costs import as_costs
from .kk import KK_MAX_CELLS, karmarkar_karp
from .locality import locality_plan
from .lpt import lpt, refine_swaps
from .matching import _sparse_sum, assign_buckets_greedy
from .milp import MILP_MAX_CELLS, milp_balance
from .topology import Topology, assign_buckets, transfer_bytes

__all__ = [
    "BalanceConfig", "Method", "BATCHED_ABOVE", "KK_MAX_CELLS", "MILP_MAX_CELLS", "PAIR_ROUNDS", "PAIR_COUNT",
    "loads", "makespan", "lower_bound", "lpt", "lpt_batched", "karmarkar_karp", "milp_balance", "refine_swaps",
    "refine_pairs", "balance", "plan_balance", "warm_up",
]

_REEXPORTED = (_cap_weights, _check_ranks, _equal_quota, _order_desc)
"""Private helpers other modules import from here (padded.py: ``_check_ranks``, ``_order_desc``)."""


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
    2. Buckets are interchangeable: map them to ranks to move the fewest inter-node, then intra-node bytes
       (greedy sparse matching by default, NOTE [ Greedy bucket matching ]; ``assignment="exact"`` for the
       linear assignment).
    3. Locality (default 2 %): a plan that keeps items home with max load <= ``(1 + tol) * M`` replaces it
       when it moves fewer bytes (NOTE [ Locality ]).

    ``costs[i]``: the item's cost (additive: use `padded_partition()` for padded
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
    home = None
    if config.locality_tolerance is not None and not config.equal_counts:
        # Any bucket -> rank mapping is a permutation of the loads: the limit does not depend on it.
        limit = makespan(arr, buckets, num_ranks) * (1 + config.locality_tolerance)
        home = locality_plan(arr, src, num_ranks, limit, topology, item_bytes=nbytes, cap=cap,
                             cap_weights=weights if cap_weights is not None else None)
        if home is not None and _home_beats_any_mapping(home, buckets, src, nbytes, topology):
            return home.tolist()
    dest = _place_buckets(buckets, src, topology, nbytes, config)
    if home is not None and transfer_bytes(home, src, nbytes, topology) < transfer_bytes(dest, src, nbytes, topology):
        dest = home
    return dest.tolist()


def _home_beats_any_mapping(home: np.ndarray, buckets: np.ndarray, sources: np.ndarray, nbytes: np.ndarray,
                            topology: Topology) -> bool:
    """True when the locality plan moves fewer bytes than *every* bucket -> rank mapping could.

    A mapping keeps at most, per bucket, its bytes on its best node (``sum_b max_n bytes(b, n)``), or with
    one node, on its best rank. If the home plan already moves less than ``total - that``, mapping the
    buckets (the costly part at 2,560 ranks) can be skipped -- the answer is the same.
    """
    inter, intra = transfer_bytes(home, sources, nbytes, topology)
    total = float(nbytes.sum())
    if topology.num_nodes > 1:
        keys, kept = _sparse_sum(buckets * topology.num_nodes + topology.node_of(sources), nbytes)
        return inter < total - _best_per_bucket(keys // topology.num_nodes, kept)
    keys, kept = _sparse_sum(buckets * topology.num_ranks + sources, nbytes)
    return intra < total - _best_per_bucket(keys // topology.num_ranks, kept)


def _best_per_bucket(bucket_of_key: np.ndarray, kept: np.ndarray) -> float:
    """Sum over buckets of the largest entry (keys sorted, so each bucket's entries are contiguous)."""
    if not kept.size:
        return 0.0
    starts = np.flatnonzero(np.concatenate(([True], bucket_of_key[1:] != bucket_of_key[:-1])))
    return float(np.maximum.reduceat(kept, starts).sum())


def _place_buckets(buckets: np.ndarray, sources: np.ndarray, topology: Topology, nbytes: np.ndarray,
                   config: BalanceConfig) -> np.ndarray:
    """Destination of each item once its bucket has a rank (identity when ``node_assignment`` is off)."""
    if not config.node_assignment:
        return buckets
    assign = assign_buckets if config.assignment == "exact" else assign_buckets_greedy
    return assign(buckets, sources, topology, item_bytes=nbytes)[buckets]


def warm_up() -> None:
    """Run one small plan so the first real step pays no first-call costs (NOTE [ No stall on the first step ]).

    Cheap (well under a millisecond after import); call it where a loader or orchestrator is constructed.
    """
    plan_balance([3.0, 2.0, 2.0, 1.0], [0, 0, 1, 1], 2, ranks_per_node=1, item_bytes=[3, 2, 2, 1])
    lpt_batched(np.array([3.0, 2.0, 1.0]), 2)
