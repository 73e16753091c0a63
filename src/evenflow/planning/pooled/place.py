"""Steps 3 and 4 of the global round plan ([`evenflow.planning.pooled.plan`][evenflow.planning.pooled.plan]): deal the
chosen groups into equal-cost steps, then place each step's groups on the ranks that already hold most of their bytes.
Pure.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

NODE_WEIGHT_SHIFT = 1 << 20
"""Matching score ``bytes on the node * shift + bytes on the rank``; the node term dominates while a rank's
bytes stay below 2**20 units -- larger byte counts are scaled down first (see ``_scaled_bytes``)."""


# -- 3. equal-cost steps, 4. least movement --------------------------------------------------------------------

def _deal(groups: list[np.ndarray], times: np.ndarray, world: int, steps: int) -> np.ndarray:
    """Slot (``step * W + position``) of each group: costliest first, W consecutive groups per step."""
    order = np.lexsort((np.arange(len(groups)), -times))
    slot = np.empty(len(groups), dtype=np.int64)
    slot[order] = np.arange(len(groups))
    # Fewer groups than T * W (a drain that could not split further): spread the IDLE slots over steps
    # instead of leaving the last step near-empty -- group j of the costliest-first order goes to step j % T.
    if len(groups) < steps * world:
        slot[order] = (np.arange(len(groups)) % steps) * world + np.arange(len(groups)) // steps
    return slot


def _scaled_bytes(nbytes: np.ndarray) -> np.ndarray:
    total = float(nbytes.sum())
    scale = max(1.0, total / (NODE_WEIGHT_SHIFT - 1))
    return np.ceil(nbytes / scale)


def _sparse_sum(keys: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys (ascending) and the summed weight of each: a sparse bincount."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    if not k.size:
        return k, weights[:0]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    return k[starts], np.add.reduceat(weights[order], starts)


def _place(slot_of_item: np.ndarray, sources: np.ndarray, nbytes: np.ndarray, world: int, steps: int,
           per_node: int, *, exact: bool) -> np.ndarray:
    """Rank of each slot: greedy max-weight matching per step on (node bytes, rank bytes) already there.

    Sparse: a slot's items come from a few ranks, so only (slot, source rank) pairs that hold bytes are
    candidates -- never a dense ``[slots, W]`` matrix (52 M entries at 2,560 ranks). ``exact``: an exact
    assignment per step instead (the caller decides: ``EXACT_MATCH_MAX_RANKS`` in
    [`evenflow.planning.pooled.plan`][evenflow.planning.pooled.plan]).
    """
    units = _scaled_bytes(nbytes)
    if exact:
        return _place_exact(slot_of_item, sources, units, world, steps, per_node)
    nodes = -(-world // per_node)
    pair, own = _sparse_sum(slot_of_item * world + sources, units)
    npair, nown = _sparse_sum(slot_of_item * nodes + sources // per_node, units)
    s, r = pair // world, pair % world
    on_node = nown[np.searchsorted(npair, s * nodes + r // per_node)]
    order = np.lexsort((r, s, -(on_node * NODE_WEIGHT_SHIFT + own), s // world))
    rank_of = [-1] * (steps * world)
    used = np.zeros((steps, world), dtype=bool)
    used_list = [[False] * world for _ in range(steps)]
    for si, ri in zip(s[order].tolist(), r[order].tolist()):
        t = si // world
        if rank_of[si] < 0 and not used_list[t][ri]:
            rank_of[si] = ri
            used_list[t][ri] = True
    used[:] = used_list
    out = np.array(rank_of, dtype=np.int64)
    _place_rest(out, used, npair, nown, nodes, world, per_node)
    return out


def _place_exact(slot_of_item: np.ndarray, sources: np.ndarray, units: np.ndarray, world: int, steps: int,
                 per_node: int) -> np.ndarray:
    """[`_place()`][_place] by an exact assignment per step on the same score (node bytes * shift + rank bytes)."""
    slots = steps * world
    own = np.bincount(slot_of_item * world + sources, weights=units, minlength=slots * world).reshape(slots, world)
    node_of = np.arange(world) // per_node
    on_node = np.zeros((slots, int(node_of[-1]) + 1))
    np.add.at(on_node.T, node_of, own.T)  # on_node[s, n]: bytes of slot s on node n
    score = on_node[:, node_of] * NODE_WEIGHT_SHIFT + own
    rank_of = np.empty(slots, dtype=np.int64)
    for t in range(steps):
        rows, cols = linear_sum_assignment(score[t * world:(t + 1) * world], maximize=True)
        rank_of[t * world + rows] = cols
    return rank_of


def _place_rest(rank_of: np.ndarray, used: np.ndarray, npair: np.ndarray, nown: np.ndarray, nodes: int,
                world: int, per_node: int) -> None:
    """Slots without a kept rank: the lowest free rank on the node holding most of their bytes, else the
    lowest free rank anywhere."""
    for si in np.flatnonzero(rank_of < 0).tolist():
        t = si // world
        lo, hi = np.searchsorted(npair, [si * nodes, (si + 1) * nodes])
        ri = -1
        for k in (lo + np.lexsort((npair[lo:hi], -nown[lo:hi]))).tolist():
            node = int(npair[k]) - si * nodes
            free = np.flatnonzero(~used[t, node * per_node:(node + 1) * per_node])
            if free.size:
                ri = node * per_node + int(free[0])
                break
        if ri < 0:
            ri = int(np.argmin(used[t]))  # the first free rank (a step has W slots for W ranks)
        rank_of[si] = ri
        used[t, ri] = True

