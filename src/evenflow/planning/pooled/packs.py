"""Padding-free packs balanced on time and mixed (``cost="summed"``): a round's samples dealt into its
steps' packs. Pure.

NOTE [ Packed steps balanced on time ]
    A pack's time is the sum of its sequences' ``f(L) = gamma + alpha L + beta L^2`` (a ``"summed"``
    [`TimeCost`][evenflow.planning.timecost.TimeCost]). Best fit decreasing fills packs to the token budget, so two
    full packs cost alike by tokens, yet one holding a 16,384-token chat takes 1.67 times one of 300 short chats
    under the default cost (NOTE [ The default time cost ]). And best fit's packs are length-homogeneous (a long
    opener and its fillers), so steps of packs that cost alike are homogeneous too. Each round, best fit's packs
    still decide how many steps go and which samples (the stratified selection, NOTE [ A round emits a sample of
    the buffer ]); [`deal_round()`][deal_round] then deals those samples again into the round's ``T * W`` packs, the
    token budget a hard limit:

    1. *anchors* -- sequences above ``ANCHOR_SHARE`` of a pack's mean time -- W at a time, longest first, to the
       step with the least time so far, one to each of its ranks: in a full step no rank can make up for a
       missing long sequence with more tokens, so long ones share a step W at a time (the few left over are
       dealt with the rest);
    2. the rest, longest first, ``T * W`` at a time to the packs in the order of their time so far (the longest
       to the least loaded), each pack keeping its share of room for the short ones;
    3. short ones (below ``SMALL_SHARE``) by best fit into the room left; what finds no room moves one placed
       item to another pack ([`_Deal.chain()`][_Deal.chain]) or waits for the next round, and the gaps left are filled
       from the rest of the buffer, largest that fits first -- so a round trains as many tokens as best fit's packs;
    4. each step's slowest pack gives one sequence to, or swaps one with, another pack while that lowers it
       (``refine`` in lpt.py; LPT's 4/3 is loose for a handful of sequences per rank).

    Every step so gets a share of every length (chitchat, B = 16,384, W = 4: H 1.47 where best fit's steps gave
    2.57; lower on 13 of benchmarks/bench_packing.py's 14 configurations), every rank a share of its step's, and
    the ranks' times even out. The drain (the epoch's last round, with room to spare) skips the anchors and fills
    each step's packs up to its slowest one instead: a sequence as long as the budget sets its step's pace, and
    the step's other ranks may as well take more. When the deal would train more than ``SHORTFALL`` (plan.py)
    fewer tokens than best fit's packs (late in an epoch the short ones run out; the rounds would add steps), and
    for a drain that does not fit, best fit's packs go: in steps of packs of similar time (NOTE [ Stratified steps ]),
    each step's sequences dealt again longest first to the least loaded rank (``balance_steps`` in lpt.py), the drain's
    into all ``T * W`` packs at once (``drain_packs``) -- halving best fit's costliest packs instead left steps of W
    single sequences of unrelated lengths (measured: 471 against 3,484 tokens at step 403 of 406).

    Example, W = 2, budget 12, ``f(L) = L + L^2 / 8``, one step of [6, 6, 2, 2, 2, 2, 2, 2]: best fit packs [6, 6]
    (21) and [2, 2, 2, 2, 2, 2] (15); the deal gives each rank one 6 and three 2s (18 and 18).

    With ``grad_accum_steps > 1`` each loader step is a micro-batch and each is balanced: FSDP gathers parameters
    for every micro-batch (the ranks wait for each other at every one), and under DDP's ``no_sync`` only the
    window's sum matters, which balanced micro-batches balance too.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["deal_round"]

BLOCK_FIT = 0.9
"""Short items go ``T * W`` at a time while at least this share of a deal fits; then one at a time, best fit."""

CHAIN_TRIES = 8
"""Items the deal could not place that may each move one placed item to make room (a count, not a clock; the
rest wait for the next round, and gap filling takes their place)."""

SMALL_SHARE = 0.01
"""A sequence below this share of a pack's mean time is placed by best fit, after all longer ones: it moves the
balance little, and filling the gaps tightest first keeps the packs as full as best fit decreasing makes them."""

ANCHOR_SHARE = 0.1
"""A sequence whose time is above this share of a pack's mean time is an *anchor*: anchors go W to a step, one
per rank, since fewer than W of them in a step leave the ranks without one short on time (the token budget binds
on every rank of a full step, so no rank can make up for it with more tokens)."""


def deal_round(items: np.ndarray, lengths: np.ndarray, item_time: np.ndarray, first: np.ndarray, steps: int,
               world: int, cap: int, most: int | None = None, spare: np.ndarray | None = None,
               drain: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
    """The round's items dealt into ``steps * world`` packs, step-major (pack ``t * W + r``), mixed and balanced
    (NOTE [ Packed steps balanced on time ]); returns the packs and the items that found no room (they stay
    buffered). ``first`` (a bool per item of ``lengths``): items placed before any other, into empty packs, so
    they go this round (the oldest item: bounded waiting, NOTE [ Choosing whole steps ]). ``spare``: buffered
    items not chosen this round; the gaps the deal leaves are filled from them, largest that fits first, so a
    round trains as many tokens as best fit's packs would. ``drain``: the epoch's last round, whose steps have
    room to spare: a step's packs fill up to its slowest one (a sequence as long as the budget sets the pace of its
    step, and the other ranks of that step may as well take more), instead of every pack of the round alike.

    >>> packs, left = deal_round(np.arange(6), np.array([6, 6, 2, 2, 2, 2]), np.array([9.0, 9, 2, 2, 2, 2]),
    ...                          np.zeros(6, bool), 1, 2, 10)
    >>> [p.tolist() for p in packs], left.tolist()
    ([[0, 2, 4], [1, 3, 5]], [])
    """
    deal = _Deal(items, lengths, item_time, steps, world, cap, most)
    deal.to_step_max = drain
    order = items[np.lexsort((items, -item_time[items]))]
    mean = float(item_time[items].sum()) / (steps * world)
    old, count = order[first[order]], steps * world
    unplaced = sum((deal.deal(old[k:k + count]) for k in range(0, old.size, count)), [])  # into empty packs
    order = order[~first[order]]
    is_anchor = item_time[order] > ANCHOR_SHARE * mean
    whole = 0 if drain else int(is_anchor.sum()) // world * world  # the drain fills up to each step's slowest
    for k in range(0, whole, world):  # W anchors to the step with the least time, one to each of its ranks
        unplaced += deal.deal(order[k:k + world], step=int(np.argmin(deal.step_load)))
    small = item_time[order] < SMALL_SHARE * mean
    mid = order[whole:][~small[whole:]]
    deal.reserve = int(lengths[order[small]].sum()) // (steps * world)
    for k in range(0, mid.size, steps * world):  # a deal of T * W to the packs by time so far
        unplaced += deal.deal(mid[k:k + steps * world])
    deal.reserve = 0
    unplaced += deal.best_fit(order[small])
    unplaced = sorted(unplaced, key=lambda i: (-int(lengths[i]), i))
    unplaced = [u for k, u in enumerate(unplaced) if k >= CHAIN_TRIES or not deal.chain(u)]
    if spare is not None and len(spare):
        deal.fill_gaps(spare)
    return deal.packs(), np.array(sorted(unplaced), dtype=np.int64)


class _Deal:
    """Packs being filled: per pack its room (tokens), the items it may still take (``most``) and its time."""

    def __init__(self, items: np.ndarray, lengths: np.ndarray, item_time: np.ndarray, steps: int, world: int,
                 cap: int, most: int | None) -> None:
        self.items, self.lengths, self.item_time, self.world = items, lengths, item_time, world
        count = steps * world
        self.room = np.full(count, cap, dtype=np.int64)
        self.left = np.full(count, most if most is not None else len(lengths), dtype=np.int64)
        self.load = np.zeros(count)
        self.step_load = np.zeros(steps)
        self.pack_of = np.full(len(lengths), -1, dtype=np.int64)
        """Pack of each item (of the union), -1: not placed."""
        self.reserve = 0
        """Room a least-loaded placement leaves in every pack for its share of the short items."""
        self.to_step_max = False
        """Fill each step's packs up to its slowest one (the drain, which has room to spare) instead of evening
        every pack of the round."""

    def _add(self, p: int, i: int, sign: int = 1) -> None:
        self.room[p] -= sign * int(self.lengths[i])
        self.left[p] -= sign
        self.load[p] += sign * float(self.item_time[i])
        self.step_load[p // self.world] += sign * float(self.item_time[i])
        self.pack_of[i] = p if sign > 0 else -1

    def _key(self, packs: np.ndarray) -> np.ndarray:
        """What "least loaded" means: a pack's time, or (``to_step_max``) its time less its step's slowest pack's,
        so the packs lagging their step's slowest fill first."""
        if not self.to_step_max:
            return self.load[packs]
        slowest = np.maximum.reduceat(self.load, np.arange(0, self.load.size, self.world))
        return self.load[packs] - slowest[packs // self.world]

    def put(self, i: int, packs: np.ndarray | None = None) -> int:
        """Item i into the least loaded pack (of ``packs``) that has room for it and the reserve, else into the
        one with the least room that holds it; the pack, or -1."""
        size = int(self.lengths[i])
        idx = np.arange(self.room.size) if packs is None else packs
        room, ok = self.room[idx], self.left[idx] > 0
        kept = ok & (room >= size + self.reserve)
        if kept.any():
            p = int(idx[kept][np.argmin(self._key(idx)[kept])])
        elif (ok & (room >= size)).any():
            fits = ok & (room >= size)
            p = int(idx[fits][np.argmin(room[fits])])
        else:
            return -1
        self._add(p, i)
        return p

    def deal(self, block: np.ndarray, step: int | None = None) -> list[int]:
        """``block`` (longest first) to the packs (of ``step``) in the order of their time so far, the longest to
        the least loaded; an item whose pack lacks room (and the reserve) goes on its own ([`put()`][put]). Returns
        what found no room."""
        w = self.world
        idx = np.arange(self.room.size) if step is None else np.arange(step * w, (step + 1) * w)
        free = idx[self.left[idx] > 0]
        packs = free[np.lexsort((free, self._key(free)))][:block.size]
        fit = self.room[packs] >= self.lengths[block[:packs.size]] + self.reserve
        self._add_many(packs[fit], block[:packs.size][fit])
        rest = np.concatenate((block[:packs.size][~fit], block[packs.size:]))
        for where in (idx, None if step is None else np.arange(self.room.size)):  # misfits: the roomiest packs
            if not rest.size or where is None:
                continue
            free = where[self.left[where] > 0]
            packs = free[np.lexsort((free, -self.room[free]))][:rest.size]
            fit = self.room[packs] >= self.lengths[rest[:packs.size]] + self.reserve
            self._add_many(packs[fit], rest[:packs.size][fit])
            rest = np.concatenate((rest[:packs.size][~fit], rest[packs.size:]))
        return [i for i in rest.tolist() if self.put(i, idx) < 0 and (step is None or self.put(i) < 0)]

    def _add_many(self, packs: np.ndarray, items: np.ndarray) -> None:
        """Item k into pack k, for distinct packs."""
        times = self.item_time[items]
        self.room[packs] -= self.lengths[items]
        self.left[packs] -= 1
        self.load[packs] += times
        np.add.at(self.step_load, packs // self.world, times)
        self.pack_of[items] = packs

    def best_fit(self, items: np.ndarray) -> list[int]:
        """Each item (longest first) into the pack with the least room that holds it; returns what fits nowhere.

        While every pack of a deal has room for its item, ``T * W`` of them go at once, to the roomiest packs
        (the gaps even out); the last ones, where room runs short, one at a time, tightest first."""
        count, rest = self.room.size, items
        while rest.size:
            block = rest[:count]
            open_ = np.flatnonzero(self.left > 0)
            packs = open_[np.lexsort((open_, -self.room[open_]))][:block.size]
            fit = self.room[packs] >= self.lengths[block[:packs.size]]
            if fit.sum() < BLOCK_FIT * block.size:  # room runs short: one at a time from here
                break
            self._add_many(packs[fit], block[:packs.size][fit])
            rest = np.concatenate((block[:packs.size][~fit], block[packs.size:], rest[count:]))
        rest = rest[np.lexsort((rest, -self.lengths[rest]))]  # longest first again
        rooms = sorted((int(r), p) for p, r in enumerate(self.room.tolist()) if self.left[p] > 0 and r > 0)
        out = []
        for i in rest.tolist():
            k = bisect.bisect_left(rooms, (int(self.lengths[i]), -1))
            if k == len(rooms):
                out.append(i)
                continue
            _, p = rooms.pop(k)
            self._add(p, i)
            if self.room[p] > 0 and self.left[p] > 0:
                bisect.insort(rooms, (int(self.room[p]), p))
        return out

    def chain(self, u: int) -> bool:
        """Place u by moving one placed, shorter item of some pack to another pack that has room for it (the
        room is there, in pieces)."""
        size = int(self.lengths[u])
        placed = self.items[self.pack_of[self.items] >= 0]
        if not placed.size:
            return False
        pack = self.pack_of[placed]
        room = np.where(self.left > 0, self.room, -1)
        top = np.argsort(-room, kind="stable")[:2]  # the roomiest other pack of each item's pack
        other = np.where(pack == top[0], room[top[1]] if top.size > 1 else -1, room[top[0]])
        ls = self.lengths[placed]
        ok = (ls < size) & (ls + self.room[pack] >= size) & (ls <= other)
        if not ok.any():
            return False
        k = np.flatnonzero(ok)[np.lexsort((placed[ok], ls[ok]))[0]]
        v, p = int(placed[k]), int(pack[k])
        q = int(top[0]) if int(top[0]) != p else int(top[1])
        self._add(p, v, -1)
        self._add(q, v)
        self._add(p, u)
        return True

    def fill_gaps(self, spare: np.ndarray) -> None:
        """Each pack's gap, roomiest first, with the longest spare items that fit (while it may take items)."""
        cand = spare[self.lengths[spare] <= self.room.max()]
        cand = cand[np.lexsort((cand, self.lengths[cand]))]
        sizes = self.lengths[cand].tolist()
        ids = cand.tolist()
        for p in np.argsort(-self.room, kind="stable").tolist():
            while self.room[p] > 0 and self.left[p] > 0 and sizes:
                k = bisect.bisect_right(sizes, int(self.room[p])) - 1
                if k < 0:
                    break
                sizes.pop(k)
                self._add(p, ids.pop(k))

    def packs(self) -> list[np.ndarray]:
        count = self.room.size
        placed = np.flatnonzero(self.pack_of >= 0)
        pack = self.pack_of[placed]
        by_pack = np.argsort(pack, kind="stable")
        cuts = np.searchsorted(pack[by_pack], np.arange(count + 1))
        return [placed[by_pack[cuts[p]:cuts[p + 1]]] for p in range(count)]
