"""The fallback of NOTE [ Packed steps balanced on time ] (packs.py): best fit's packs, each step's sequences dealt
again longest first to the least loaded rank (LPT under the token budget), the drain's into all of its packs at
once, and the swap that lowers a step's slowest pack. Pure.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["deal_by_time", "pack_sums", "refine", "balance_steps", "drain_packs", "IMPROVEMENT"]

IMPROVEMENT = 1e-9
"""Relative margin a step's new slowest pack must beat the old one by (float sums in another order differ by
rounding: without it a deal of equal quality would flip on the last bit)."""


REFINE_ROUNDS = 2
"""Moves or swaps per pack a step's refinement may make (a count, not a clock)."""

REFINE_PARTNERS = 8
"""Packs the slowest one may trade with per move, the least loaded first (a count: at 2,560 ranks a step has
2,560 packs, and trying them all per move cost seconds)."""

REFINE_SLACK = 0.002
"""A step whose slowest pack is within this fraction of its mean is left as dealt (nothing to gain)."""


def deal_by_time(sizes: Sequence[int], times: Sequence[float], count: int, cap: int,
                 most: int | None = None) -> list[int] | None:
    """Pack (0..count-1) of each item, items in the given order (longest first): the pack with the least time so
    far among those with room (``cap`` tokens, ``most`` items), ties to the lowest pack; ``None`` when an item
    fits in no pack.

    >>> deal_by_time([6, 6, 2, 2, 2, 2, 2, 2], [10.5, 10.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5], 2, 12)
    [0, 1, 0, 1, 0, 1, 0, 1]
    >>> deal_by_time([7, 7, 7], [1.0, 1.0, 1.0], 2, 12) is None
    True
    """
    n = len(sizes)
    suffix_min = np.minimum.accumulate(np.asarray(sizes, dtype=np.int64)[::-1])[::-1].tolist() if n else []
    heap = [(0.0, p) for p in range(count)]  # (time so far, pack): already a heap
    room = [cap] * count
    left = [most if most is not None else n] * count
    out = [0] * n
    for k in range(n):
        size = sizes[k]
        parked = []
        while heap:
            p = heap[0][1]
            if room[p] >= size and left[p] > 0:
                break
            entry = heapq.heappop(heap)
            if room[p] >= suffix_min[k] and left[p] > 0:  # a later, shorter item may still fit
                parked.append(entry)
        if not heap:
            return None
        load, p = heap[0]
        room[p] -= size
        left[p] -= 1
        out[k] = p
        heapq.heapreplace(heap, (load + times[k], p))
        for entry in parked:
            heapq.heappush(heap, entry)
    return out


def _longest_first(items: np.ndarray, item_time: np.ndarray) -> np.ndarray:
    return items[np.lexsort((items, -item_time[items]))]


def _packs(items: np.ndarray, lengths: np.ndarray, item_time: np.ndarray, count: int, cap: int,
           most: int | None) -> list[np.ndarray] | None:
    order = _longest_first(items, item_time)
    dealt = deal_by_time(lengths[order].tolist(), item_time[order].tolist(), count, cap, most)
    if dealt is None:
        return None
    pack = np.asarray(dealt, dtype=np.int64)
    by_pack = np.argsort(pack, kind="stable")
    cuts = np.searchsorted(pack[by_pack], np.arange(count + 1))
    return [np.sort(order[by_pack[cuts[p]:cuts[p + 1]]]) for p in range(count)]


def pack_sums(packs: Sequence[np.ndarray], values: np.ndarray) -> np.ndarray:
    """``values`` summed over each pack, in one pass (a per-pack ``.sum()`` costs microseconds each, and a round
    at 2,560 ranks has tens of thousands of packs); an empty pack sums to 0."""
    sizes = np.fromiter((len(g) for g in packs), dtype=np.int64, count=len(packs))
    out = np.zeros(len(packs), dtype=values.dtype)
    if sizes.sum():
        held = sizes > 0
        flat = values[np.concatenate([g for g in packs if len(g)]).astype(np.int64, copy=False)]
        out[held] = np.add.reduceat(flat, np.concatenate(([0], np.cumsum(sizes[held])[:-1])))
    return out


def refine(packs: list[np.ndarray], lengths: np.ndarray, item_time: np.ndarray, cap: int,
           most: int | None = None) -> list[np.ndarray]:
    """Lower the slowest pack by the best single move or swap of one item with one of the ``REFINE_PARTNERS``
    least loaded packs (under the budget), until none lowers it or ``REFINE_ROUNDS`` moves per partner ran. LPT's
    4/3 bound is loose for a handful of sequences per rank (a drain step of 9 chats on 4 ranks: 1.154 of the mean,
    the best deal 1.083); a swap fixes most of that. Skipped when the step is within ``REFINE_SLACK`` of its
    mean."""
    return _refine([np.asarray(g, dtype=np.int64) for g in packs], lengths, item_time, cap, most)[0]


def _refine(packs: list[np.ndarray], lengths: np.ndarray, item_time: np.ndarray, cap: int,
            most: int | None, times: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray]:
    """[`refine()`][refine], given (or computing) each pack's time; returns the packs and their times."""
    times = pack_sums(packs, item_time) if times is None else times.copy()
    if not len(packs) or times.max() <= times.mean() * (1 + REFINE_SLACK):
        return packs, times
    tokens = pack_sums(packs, lengths)
    for _ in range(REFINE_ROUNDS * min(len(packs), REFINE_PARTNERS)):
        a = int(np.argmax(times))
        ga = packs[a]
        ta, la = item_time[ga], lengths[ga]
        best, choice = times[a] * (1 - IMPROVEMENT), None
        for b in np.argsort(times, kind="stable")[:REFINE_PARTNERS + 1].tolist():
            if b == a:
                continue
            gb = packs[b]
            # moves: item i of a to b (j = -1), swaps: i of a with j of b -- the larger of the two new times
            tb = np.concatenate((item_time[gb], [0.0]))
            lb = np.concatenate((lengths[gb], [0]))
            new_a = times[a] - ta[:, None] + tb[None, :]
            new_b = times[b] + ta[:, None] - tb[None, :]
            ok = (tokens[b] + la[:, None] - lb[None, :] <= cap) & (tokens[a] - la[:, None] + lb[None, :] <= cap)
            if most is not None:
                ok[:, -1] &= len(gb) < most
            worst = np.where(ok, np.maximum(new_a, new_b), np.inf)
            k = int(np.argmin(worst))
            if worst.flat[k] < best:
                best, choice = float(worst.flat[k]), (b, k // worst.shape[1], k % worst.shape[1])
        if choice is None:
            break
        b, i, j = choice
        gb = packs[b]
        moved_in = gb[j:j + 1] if j < len(gb) else gb[:0]
        packs[a] = np.sort(np.concatenate((np.delete(ga, i), moved_in)))
        packs[b] = np.sort(np.concatenate((np.delete(gb, j) if j < len(gb) else gb, ga[i:i + 1])))
        for k in (a, b):
            times[k], tokens[k] = float(item_time[packs[k]].sum()), int(lengths[packs[k]].sum())
    return packs, times


def balance_steps(groups: list[np.ndarray], slot_of_group: np.ndarray, lengths: np.ndarray, item_time: np.ndarray,
                  world: int, steps: int, cap: int, most: int | None = None,
                  redeal: bool = True) -> tuple[list[np.ndarray], np.ndarray]:
    """Each step's items dealt again to its W slots when that lowers the step's slowest pack (NOTE [ Packed steps
    balanced on time ]); returns the groups and their slots (an IDLE slot may receive items, an emptied one
    leaves the list)."""
    by_slot: list[np.ndarray | None] = [None] * (steps * world)
    for g, s in zip(groups, slot_of_group.tolist()):
        by_slot[s] = g
    out, slots = [], []
    for t in range(steps):
        packs = by_slot[t * world:(t + 1) * world]
        held = [g for g in packs if g is not None and len(g)]
        if len(held) > 1 or (held and sum(len(g) for g in held) > 1 and len(held) < world):
            as_dealt = [g if g is not None else np.zeros(0, np.int64) for g in packs]
            times = pack_sums(as_dealt, item_time)
            before = float(times.max())
            dealt = _packs(np.concatenate(held), lengths, item_time, world, cap, most) if redeal else None
            if dealt is not None:
                redealt = pack_sums(dealt, item_time)
                if redealt.max() < before:
                    as_dealt, times = dealt, redealt
            dealt, times = _refine(as_dealt, lengths, item_time, cap, most, times)
            if times.max() < before * (1 - IMPROVEMENT):
                packs = dealt
        for r, g in enumerate(packs):
            if g is not None and len(g):
                out.append(g)
                slots.append(t * world + r)
    return out, np.asarray(slots, dtype=np.int64)


def drain_packs(items: np.ndarray, lengths: np.ndarray, item_time: np.ndarray, slots: int, cap: int,
                most: int | None = None) -> list[np.ndarray] | None:
    """The drain's items in ``slots`` packs of near-equal time (``None``: the budget does not allow it, keep
    best fit's packs); empty packs are left out."""
    dealt = _packs(np.asarray(items, dtype=np.int64), lengths, item_time, slots, cap, most)
    return None if dealt is None else [g for g in dealt if len(g)]
