"""Which rank gets which balanced bucket, at any scale: a sparse greedy matching on bytes already in place.

The exact answer is a linear assignment over a dense ``[buckets, ranks]`` matrix
([`evenflow.balance.topology.assign_buckets()`][evenflow.balance.topology.assign_buckets], NOTE [ Rearrangement is an
assignment problem ]): 52 M entries and ~1 s of CPU at 2,560 ranks, plus a scipy import on first use. The structure is
sparse -- a bucket's items come from a few source ranks (most buckets from one or two) -- so only the (bucket, source
rank) pairs that hold bytes are candidates.

NOTE [ Greedy bucket matching ]
    Score each candidate pair by ``bytes of the bucket on the rank's node * 2**20 + bytes on the rank``
    (the node term first: inter-node bytes are the slow ones), visit pairs best first and take a pair when
    both its bucket and its rank are still free. A greedy maximum-weight matching keeps at least half of
    what the optimum keeps in place (each taken pair blocks at most two optimal pairs of no greater score);
    tests compare it with the exact assignment. Buckets left without a pair take the lowest free rank of the
    node that holds most of their bytes, else the lowest free rank. Example, 2 ranks: bucket 0 = 5 bytes from
    rank 1 + 1 from rank 0, bucket 1 = 4 bytes from rank 1: pairs (0, r1: 5), (1, r1: 4), (0, r0: 1) ->
    bucket 0 -> rank 1, bucket 1 -> rank 0 (4 + 1 bytes move; the optimum moves the same).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .topology import Topology, checked_buckets

__all__ = ["assign_buckets_greedy", "NODE_SHIFT"]

NODE_SHIFT = float(1 << 20)
"""Score weight of node-local bytes over rank-local ones; bytes are first scaled to < 2**20 units per pair
total, so the node term dominates and the sum stays exact in float64."""


def _sparse_sum(keys: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys (ascending) and the summed weight of each -- a bincount without the dense array.

    Keys below 2**32 sort as two stable 16-bit radix passes (low digit, then high): ~4x faster than a
    comparison sort of 81,920 int64 keys.
    """
    if not keys.size:
        return keys, weights[:0].astype(np.float64)
    if keys.min() >= 0 and keys.max() < (1 << 32):
        order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
        order = order[np.argsort((keys[order] >> 16).astype(np.uint16), kind="stable")]
    else:
        order = np.argsort(keys, kind="stable")
    k = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    return k[starts], np.add.reduceat(weights[order].astype(np.float64), starts)


def assign_buckets_greedy(bucket_of_item: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                          topology: Topology, *, item_bytes: Sequence[float] | np.ndarray | None = None,
                          num_buckets: int | None = None) -> np.ndarray:
    """Rank of each bucket by the sparse greedy matching (NOTE [ Greedy bucket matching ]). Deterministic.

    Same contract as [`evenflow.balance.topology.assign_buckets()`][evenflow.balance.topology.assign_buckets]: returns
    ``rank_of_bucket``.

    >>> topo = Topology(num_ranks=2, ranks_per_node=1)
    >>> assign_buckets_greedy([0, 0, 1], [1, 1, 0], topo).tolist()  # bucket 0 lives on rank 1: keep it there
    [1, 0]
    """
    R = topology.num_ranks
    buckets, src, B = checked_buckets(bucket_of_item, sources, R, num_buckets)
    w = np.ones(buckets.size) if item_bytes is None else np.asarray(item_bytes, dtype=np.float64)
    w = np.ceil(w / max(1.0, float(w.sum()) / (NODE_SHIFT - 1)))
    per_node, nodes = topology.ranks_per_node, topology.num_nodes
    pair, own = _sparse_sum(buckets * R + src, w)
    npair, nown = _sparse_sum(buckets * nodes + src // per_node, w)
    b, r = pair // R, pair % R
    on_node = nown[np.searchsorted(npair, b * nodes + r // per_node)]
    score = on_node * NODE_SHIFT + own
    order = np.lexsort((r, b, -score))
    rank_of = [-1] * B
    taken = [False] * R
    for bi, ri in zip(b[order].tolist(), r[order].tolist()):
        if rank_of[bi] < 0 and not taken[ri]:
            rank_of[bi] = ri
            taken[ri] = True
    out = _place_rest(rank_of, taken, npair, nown, nodes, per_node, R)
    if pair.size <= TWO_OPT_MAX_PAIRS:
        _two_opt(out, b[order], r[order], score[order], npair, nown, nodes, per_node, R)
    return out


TWO_OPT_MAX_PAIRS = 4096
"""Candidate pairs up to which [`_two_opt()`][_two_opt] runs (64 ranks x 32 items: at most 2,048; thousands of ranks
skip it -- pure-Python exchanges would cost more than the matching)."""
TWO_OPT_ROUNDS = 2
"""Passes of pairwise exchange over the candidates (a count: every rank stops alike)."""


def _two_opt(rank_of: np.ndarray, b: np.ndarray, r: np.ndarray, score: np.ndarray, npair: np.ndarray,
             nown: np.ndarray, nodes: int, per_node: int, R: int) -> None:
    """Exchange the ranks of two buckets when that keeps more in place (greedy's ties can cost bytes).

    For a candidate (bucket b, rank r) with b on r_b and r holding b', swap when
    ``s(b, r) + s(b', r_b) > s(b, r_b) + s(b', r)`` (``s``: the matching score, 0 for absent pairs).
    Example (2 ranks): b0 = 6 B from rank 0 + 2 B from rank 1, b1 = 6 B from rank 0; greedy ties put b0 on
    rank 0 (6 kept); the exchange gives b0 rank 1 and b1 rank 0 (8 kept) -- the exact optimum.
    """
    pair_score = dict(zip((b * R + r).tolist(), score.tolist()))
    node_score = dict(zip(npair.tolist(), (nown * NODE_SHIFT).tolist()))

    def s(bucket: int, rank: int) -> float:
        got = pair_score.get(bucket * R + rank)
        return got if got is not None else node_score.get(bucket * nodes + rank // per_node, 0.0)

    holder = np.full(R, -1, dtype=np.int64)
    holder[rank_of] = np.arange(rank_of.size)
    held = holder.tolist()
    where = rank_of.tolist()
    for _ in range(TWO_OPT_ROUNDS):
        changed = False
        for bi, ri in zip(b.tolist(), r.tolist()):
            rb, other = where[bi], held[ri]
            if rb == ri:
                continue
            gain = s(bi, ri) - s(bi, rb) + ((s(other, rb) - s(other, ri)) if other >= 0 else 0.0)
            if gain > 0:
                where[bi], held[ri], held[rb] = ri, bi, other
                if other >= 0:
                    where[other] = rb
                changed = True
        if not changed:
            break
    rank_of[:] = where


def _place_rest(rank_of: list[int], taken: list[bool], npair: np.ndarray, nown: np.ndarray, nodes: int,
                per_node: int, R: int) -> np.ndarray:
    """Unmatched buckets: the lowest free rank of their best node, else the lowest free rank anywhere."""
    free_by_node = [[r for r in range(n * per_node, min(R, (n + 1) * per_node)) if not taken[r]][::-1]
                    for n in range(nodes)]  # reversed: pop() gives the lowest
    for bi in [k for k, v in enumerate(rank_of) if v < 0]:
        lo, hi = np.searchsorted(npair, [bi * nodes, (bi + 1) * nodes])
        prefs = (npair[lo:hi][np.lexsort((npair[lo:hi], -nown[lo:hi]))] - bi * nodes).tolist()
        node = next((n for n in prefs if free_by_node[n]), None)
        if node is None:
            node = next(n for n in range(nodes) if free_by_node[n])  # B <= R: a free rank exists
        rank_of[bi] = free_by_node[node].pop()
    return np.array(rank_of, dtype=np.int64)
