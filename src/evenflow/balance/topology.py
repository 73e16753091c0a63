"""Node-wise rearrangement: which rank gets which balanced bucket, so that the fewest bytes cross nodes. Pure.

A balancer produces ``R`` buckets of equal-ish cost; any permutation of buckets over ranks is equally
balanced. Placing bucket ``b`` on rank ``r`` moves every item of ``b`` that does not live on ``r`` already:

* ``inter[b, r]`` -- bytes of ``b`` whose source is on another node than ``r`` (slow links: IB / Ethernet);
* ``intra[b, r]`` -- bytes of ``b`` from other ranks of ``r``'s node (fast links: NVLink / shared memory).

NOTE [ Rearrangement is an assignment problem ]
    Total bytes moved is a sum over (bucket, rank) pairs of a matrix entry, and every bucket goes to exactly
    one rank: a linear assignment problem, solved exactly by ``scipy.optimize.linear_sum_assignment``.
    Minimizing inter-node bytes first and intra-node bytes second is the same problem with the entry
    ``inter * W + intra``, ``W`` larger than any possible intra total. Example, 2 nodes x 1 rank, bucket 0 =
    items from rank 1, bucket 1 = items from rank 0: the identity moves everything across nodes; the swap
    moves nothing. Float64 holds the combined integers exactly while ``total * (total + 1) < 2**53``; larger
    byte counts are first measured in power-of-two units (exact in those units).

    The most loaded *link* (max over nodes of bytes leaving or entering the node) is not a sum, so it is a
    real MILP ([`assign_buckets_milp()`][assign_buckets_milp], HiGHS): bucket-to-node binaries, bounded above by the
    assignment's own bottleneck, with total inter-node bytes as a tie-break; ranks inside each node are then
    an exact assignment on intra-node bytes.

Topology comes from an explicit ``ranks_per_node`` or, at the edge of a program, from torchrun's
``LOCAL_WORLD_SIZE`` ([`topology_from_env()`][topology_from_env], read once, never written).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Topology", "topology_from_env", "transfer_matrices", "assign_buckets", "assign_buckets_milp",
           "transfer_bytes", "link_loads", "transfer_stats"]

EXACT_LIMIT = 2 ** 26
"""Byte totals up to this many units keep ``inter * (total + 1) + intra`` exact in float64 (2**52 < 2**53)."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Ranks ``0..num_ranks-1`` on nodes of ``ranks_per_node`` consecutive ranks (torchrun's layout)."""

    num_ranks: int
    ranks_per_node: int
    """Ranks per node; ``num_ranks`` for a single node. The last node may be partial."""

    def __post_init__(self) -> None:
        for name in ("num_ranks", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.ranks_per_node)

    def node_of(self, ranks: int | np.ndarray) -> np.ndarray:
        """Node index of each rank: ``Topology(num_ranks=4, ranks_per_node=2).node_of(np.arange(4))`` -> [0 0 1 1]."""
        return np.asarray(ranks, dtype=np.int64) // self.ranks_per_node


def topology_from_env(num_ranks: int, *, environ: Mapping[str, str] | None = None) -> Topology:
    """Topology from torchrun's ``LOCAL_WORLD_SIZE`` (ranks per node). Call once, at the edge.

    Without ``LOCAL_WORLD_SIZE`` (not launched by torchrun) every rank is assumed on one node. ``environ``
    defaults to ``os.environ``, which is only read.
    """
    env = os.environ if environ is None else environ
    raw = env.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return Topology(num_ranks=num_ranks, ranks_per_node=num_ranks)
    try:
        per_node = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer; launch with torchrun or pass "
                         "ranks_per_node explicitly") from None
    if per_node < 1 or per_node > num_ranks:
        raise ValueError(f"LOCAL_WORLD_SIZE={per_node} is outside [1, world size {num_ranks}]; pass "
                         "ranks_per_node explicitly")
    return Topology(num_ranks=num_ranks, ranks_per_node=per_node)


def _units(item_bytes: np.ndarray) -> np.ndarray:
    """Integer byte units with a total <= EXACT_LIMIT (NOTE [ Rearrangement is an assignment problem ])."""
    b = np.ceil(np.asarray(item_bytes, dtype=np.float64))
    total = float(b.sum())
    if total <= EXACT_LIMIT:
        return b.astype(np.int64)
    shift = int(np.ceil(np.log2(total / EXACT_LIMIT)))
    # Round each item up, so that no moved item ever counts as free; total grows by < n units.
    units = np.ceil(b / 2.0 ** shift)
    while units.sum() > EXACT_LIMIT * 2:  # pragma: no cover - only with millions of tiny items
        shift += 1
        units = np.ceil(b / 2.0 ** shift)
    return units.astype(np.int64)


def transfer_matrices(bucket_of_item: np.ndarray, sources: np.ndarray, item_bytes: np.ndarray,
                      topology: Topology, num_buckets: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(inter, intra)``, each ``[num_buckets, num_ranks]``: bytes moved if bucket b lands on rank r."""
    R = topology.num_ranks
    B = R if num_buckets is None else num_buckets
    bucket_of_item = np.asarray(bucket_of_item, dtype=np.int64)
    sources = np.asarray(sources, dtype=np.int64)
    w = np.asarray(item_bytes, dtype=np.float64)
    nodes = topology.num_nodes
    node_of_rank = topology.node_of(np.arange(R))
    per_node = np.bincount(bucket_of_item * nodes + node_of_rank[sources], weights=w, minlength=B * nodes)
    per_node = per_node.reshape(B, nodes)
    total = per_node.sum(axis=1)
    home_node = per_node[:, node_of_rank]  # [B, R]: bytes of b already on r's node
    inter = total[:, None] - home_node
    intra = home_node.copy()
    # Subtract bytes already on rank r itself (sparse: at most one (b, r) entry per item).
    np.subtract.at(intra, (bucket_of_item, sources), w)
    return inter, intra


def assign_buckets(bucket_of_item: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                   topology: Topology, *, item_bytes: Sequence[float] | np.ndarray | None = None,
                   num_buckets: int | None = None) -> np.ndarray:
    """Rank of each bucket minimizing (inter-node bytes, intra-node bytes) lexicographically. Exact.

    Buckets are ``0..num_buckets-1`` (default ``num_ranks``; fewer buckets leave ranks empty). Returns
    ``rank_of_bucket``; the destination of item i is ``rank_of_bucket[bucket_of_item[i]]``.

    >>> topo = Topology(num_ranks=2, ranks_per_node=1)
    >>> assign_buckets([0, 0, 1], [1, 1, 0], topo).tolist()  # bucket 0 lives on rank 1: keep it there
    [1, 0]
    """
    from scipy.optimize import linear_sum_assignment

    R = topology.num_ranks
    buckets, src, B = checked_buckets(bucket_of_item, sources, R, num_buckets)
    w = _units(np.ones(buckets.size) if item_bytes is None else np.asarray(item_bytes, dtype=np.float64))
    _, cols = linear_sum_assignment(_combined_cost(buckets, src, w, topology, B))
    return cols.astype(np.int64)


def _combined_cost(buckets: np.ndarray, sources: np.ndarray, w: np.ndarray, topology: Topology,
                   num_buckets: int) -> np.ndarray:
    """``inter * W + intra`` in two passes over the ``[B, R]`` matrix (it is 52 MB at 2,560 ranks).

    ``inter = total - home`` and ``intra = home - own``, so the entry is ``total * W - home * (W - 1) - own``
    where ``own`` (bytes already on the rank) is sparse: one entry per item.
    """
    R = topology.num_ranks
    nodes = topology.num_nodes
    weight = float(w.sum()) + 1.0
    per_node = np.bincount(buckets * nodes + topology.node_of(sources), weights=w,
                           minlength=num_buckets * nodes).astype(np.float64).reshape(num_buckets, nodes)
    cost = per_node[:, topology.node_of(np.arange(R))]
    cost *= -(weight - 1.0)
    cost += (per_node.sum(axis=1) * weight)[:, None]
    np.subtract.at(cost, (buckets, sources), w.astype(np.float64))
    return cost


def transfer_bytes(dest: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                   item_bytes: Sequence[float] | np.ndarray, topology: Topology) -> tuple[float, float]:
    """``(inter-node bytes, intra-node bytes)`` moved by a plan; compare tuples lexicographically."""
    dest = np.asarray(dest, dtype=np.int64)
    src = np.asarray(sources, dtype=np.int64)
    w = np.asarray(item_bytes, dtype=np.float64)
    moved = dest != src
    cross = topology.node_of(dest) != topology.node_of(src)
    return float(w[cross].sum()), float(w[moved & ~cross].sum())


def link_loads(dest: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
               item_bytes: Sequence[float] | np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Per node, ``(bytes leaving, bytes entering)`` through its inter-node link."""
    dnode = topology.node_of(np.asarray(dest, dtype=np.int64))
    snode = topology.node_of(np.asarray(sources, dtype=np.int64))
    w = np.asarray(item_bytes, dtype=np.float64)
    cross = dnode != snode
    out = np.bincount(snode[cross], weights=w[cross], minlength=topology.num_nodes)
    into = np.bincount(dnode[cross], weights=w[cross], minlength=topology.num_nodes)
    return out, into


def transfer_stats(dest: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                   item_bytes: Sequence[float] | np.ndarray, topology: Topology) -> dict[str, float]:
    """Inter/intra/total bytes moved and the most loaded link, as a dict (for logs and benchmarks)."""
    inter, intra = transfer_bytes(dest, sources, item_bytes, topology)
    out, into = link_loads(dest, sources, item_bytes, topology)
    return {"inter_bytes": inter, "intra_bytes": intra, "moved_bytes": inter + intra,
            "max_link_bytes": float(max(out.max(initial=0.0), into.max(initial=0.0)))}


def assign_buckets_milp(bucket_of_item: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                        topology: Topology, *, item_bytes: Sequence[float] | np.ndarray | None = None,
                        objective: Literal["total", "bottleneck"] = "bottleneck", time_limit: float = 30.0,
                        num_buckets: int | None = None) -> np.ndarray:
    """Rank of each bucket from a MILP (HiGHS). Small instances; also the oracle for
    [`assign_buckets()`][assign_buckets].

    ``"total"``: the same lexicographic (inter, intra) objective as [`assign_buckets()`][assign_buckets], over
    bucket-to-rank binaries -- tests check both reach the same optimum. ``"bottleneck"``: minimize the most
    loaded node link (max over nodes of bytes leaving or entering), then total inter-node bytes, over
    bucket-to-node binaries with ``z <= `` the assignment's own bottleneck; then per node, an exact
    assignment of its buckets to its ranks on intra-node bytes. If HiGHS stops without a solution (time
    limit), the assignment's answer is returned: it is feasible and satisfies the bound.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp

    R = topology.num_ranks
    buckets = np.asarray(bucket_of_item, dtype=np.int64)
    B = R if num_buckets is None else int(num_buckets)
    src = np.asarray(sources, dtype=np.int64)
    w = _units(np.ones(buckets.size) if item_bytes is None else np.asarray(item_bytes, dtype=np.float64))
    options = {"time_limit": float(time_limit), "mip_rel_gap": 0.0, "disp": False}
    if objective == "total":
        return _milp_total(buckets, src, w, topology, B, options, time_limit)
    if objective != "bottleneck":
        raise ValueError(f"objective must be 'total' or 'bottleneck', got {objective!r}")
    warm = assign_buckets(buckets, src, topology, item_bytes=w, num_buckets=B)
    out_w, in_w = link_loads(warm[buckets], src, w, topology)
    bound = float(max(out_w.max(initial=0.0), in_w.max(initial=0.0)))
    nodes = topology.num_nodes
    per_node = np.bincount(buckets * nodes + topology.node_of(src), weights=w, minlength=B * nodes).reshape(B, nodes)
    node_inter = per_node.sum(axis=1)[:, None] - per_node  # [B, nodes]: bytes entering node n if b lands there
    matrix, lo, hi = _bottleneck_rows(per_node, node_inter, topology)
    ny = B * nodes
    cost = np.append(node_inter.ravel(), float(w.sum()) + 1.0)  # z * weight + total inter: z first, then inter
    res = milp(cost, constraints=LinearConstraint(matrix, lo, hi), integrality=np.append(np.ones(ny), 0),
               bounds=Bounds(np.zeros(ny + 1), np.append(np.ones(ny), bound)), options=options)
    if res.x is None:
        return warm
    node_of_bucket = np.argmax(res.x[:ny].reshape(B, nodes), axis=1)
    _, intra = transfer_matrices(buckets, src, w, topology, B)
    return _ranks_within_nodes(node_of_bucket, intra, topology, B)


def _milp_total(buckets, src, w, topology: Topology, B: int, options: dict, time_limit: float) -> np.ndarray:
    """The lexicographic (inter, intra) objective over bucket-to-rank binaries: the oracle of assign_buckets."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    R = topology.num_ranks
    inter, intra = transfer_matrices(buckets, src, w, topology, B)
    nv = B * R  # x[b, r] at b * R + r; each bucket on one rank, each rank at most one bucket
    rows = np.concatenate([np.repeat(np.arange(B), R), B + np.tile(np.arange(R), B)])
    cols = np.concatenate([np.arange(nv), np.arange(nv)])
    matrix = coo_array((np.ones(2 * nv), (rows, cols)), shape=(B + R, nv)).tocsr()
    lo = np.concatenate([np.ones(B), np.zeros(R)])
    weight = float(w.sum()) + 1.0
    res = milp((inter * weight + intra).ravel(), constraints=LinearConstraint(matrix, lo, np.ones(B + R)),
               integrality=np.ones(nv), bounds=Bounds(0, 1), options=options)
    if res.x is None:
        raise ValueError(f"assign_buckets_milp found no solution within {time_limit}s ({res.message}); "
                         "use assign_buckets (exact, fast) for the total-bytes objective")
    return np.argmax(res.x.reshape(B, R), axis=1).astype(np.int64)


def _bottleneck_rows(per_node: np.ndarray, node_inter: np.ndarray, topology: Topology):
    """Rows over y[b, n] (at ``b * nodes + n``) and z: one node per bucket, node capacity, ingress and egress
    of every node <= z."""
    from scipy.sparse import coo_array

    B, nodes = per_node.shape
    capacity = np.bincount(topology.node_of(np.arange(topology.num_ranks)), minlength=nodes)
    z = B * nodes
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(c: list[int], v: list[float], lower: float, upper: float) -> None:
        rows.extend([len(lo)] * len(c))
        cols.extend(c)
        vals.extend(v)
        lo.append(lower)
        hi.append(upper)

    for b in range(B):
        add(list(range(b * nodes, (b + 1) * nodes)), [1.0] * nodes, 1.0, 1.0)
    for n in range(nodes):
        idx = (np.arange(B) * nodes + n).tolist()
        add(idx, [1.0] * B, 0.0, float(capacity[n]))
        add(idx + [z], node_inter[:, n].tolist() + [-1.0], -np.inf, 0.0)  # ingress_n - z <= 0
        # egress_n = sum_b per_node[b, n] (1 - y[b, n]) <= z
        add(idx + [z], (-per_node[:, n]).tolist() + [-1.0], -np.inf, -float(per_node[:, n].sum()))
    return coo_array((vals, (rows, cols)), shape=(len(lo), z + 1)).tocsr(), lo, hi


def _ranks_within_nodes(node_of_bucket: np.ndarray, intra: np.ndarray, topology: Topology, B: int) -> np.ndarray:
    """Per node, an exact assignment of its buckets to its ranks on intra-node bytes."""
    from scipy.optimize import linear_sum_assignment

    node_of_rank = topology.node_of(np.arange(topology.num_ranks))
    rank_of_bucket = np.empty(B, dtype=np.int64)
    for n in range(topology.num_nodes):
        mine = np.flatnonzero(node_of_bucket == n)
        ranks = np.flatnonzero(node_of_rank == n)
        if mine.size:
            _, c = linear_sum_assignment(intra[np.ix_(mine, ranks)])
            rank_of_bucket[mine] = ranks[c]
    return rank_of_bucket


def checked_buckets(bucket_of_item: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
                    num_ranks: int, num_buckets: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """``(buckets, sources, num_buckets)`` as int64 arrays, validated (shared by the exact and greedy paths)."""
    R = num_ranks
    buckets = np.asarray(bucket_of_item, dtype=np.int64)
    B = R if num_buckets is None else int(num_buckets)
    if B > R:
        raise ValueError(f"{B} buckets for {R} ranks: every bucket needs its own rank; balance into at most "
                         f"num_ranks={R} buckets")
    if buckets.size and (buckets.min() < 0 or buckets.max() >= B):
        i = int(np.flatnonzero((buckets < 0) | (buckets >= B))[0])
        raise ValueError(f"item {i}: bucket {int(buckets[i])} is outside [0, {B})")
    src = np.asarray(sources, dtype=np.int64)
    return buckets, src, B
