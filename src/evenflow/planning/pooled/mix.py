"""What each optimizer step is made of, and which steps a round emits: the global plan's composition. Pure.

Tight padded micro-batches are length-homogeneous, and the W micro-batches of a balanced step must cost the
same. Dealt the obvious way -- cost-sorted groups, W neighbours per step, the fullest steps first -- the
steps are length-homogeneous too (cost neighbours are length neighbours: ``floor(B / L) * L`` is a sawtooth in
L) and the epoch runs as a length curriculum. Both train worse than random batches
([`evenflow.sim.composition`][evenflow.sim.composition] measures it). Three pieces undo that without touching the
groups:

NOTE [ Stratified steps ]
    Groups whose time costs lie within a factor ``1 + mix_tolerance`` of each other are interchangeable for
    balance. [`band_steps()`][band_steps] cuts the cost-sorted groups into such bands (whole multiples of W) and deals
    each band like cards by length: sorted by length key, the band forms W strata of m groups, and step t
    takes the t-th group of every stratum, odd strata in reverse (a serpentine, so no step gets every
    stratum's shortest). Example, W = 2, one band of keys [1, 2, 3, 4, 5, 6]: strata [1, 2, 3] and [6, 5, 4],
    steps (1, 6), (2, 5), (3, 4) -- every step mixes a short and a long group. Per-step imbalance stays within
    the band (measured: +0.005 on average at the default 0.02). What bands cannot mix: a band holds only the
    lengths whose groups cost alike, and long samples' groups cost less (few rows, ``k * L <= B``), so the
    lowest bands are long-only. At W = 2 a step's two groups come from a wide band and mix well; at W = 8 a
    random deal of the same groups mixes better than any deal that keeps steps balanced (the bench reports
    both, ``benchmarks/bench_sim.py``).

NOTE [ A round emits a sample of the buffer ]
    Every round emits T of the C candidate steps (the bands' steps). Fullest-first leaves the long,
    low-fill groups for the end; oldest-first favours many-sample groups (more items, more chances to hold
    an old one). Instead, [`select_steps()`][select_steps] draws a *systematic sample*: candidates sorted by mean sample
    length, cut into T equal chunks, one step from each at offset ``frac(round * golden ratio)`` -- so every
    stratum goes at its own rate and, over rounds, every position in a chunk is hit. Two corrections:
    * bounded waiting: the step holding the oldest item goes once that item has waited ``max_wait_rounds``
      (it replaces its own chunk's pick), so NOTE [ Choosing whole steps ]'s bound holds. One a round, not
      every old one: forcing up to T old steps (oldest first, steering around them) cut the longest wait on
      chitchat x8 (budget 16,384, W = 2) from 107 rounds to 67 but let the deferred strata flood the rounds
      (q_cv 0.020 -> 0.286; 0.016 -> 0.496 at W = 8);
    * steering: groups are lumpy (a group of 300 tiny chats is one pick), so a round's mean sample length
      drifts from the epoch's. When the round's picks are off the mean of everything seen so far (emitted
      before, per ``EpochProgress``, and buffered) by more than ``STEER_TOLERANCE`` (relative), picks are
      swapped *within* their chunks (a chunk keeps its length stratum) until they are back.
    Open groups -- the partial group at the short end, which could still take an item -- sit out while the
    buffer refills (they fill up instead of costing an extra step), as the ``G mod W`` least full ones do.
    Known cost of the steering: a step of many tiny samples (a 4,096-token micro-batch of ~100 chats of <= 47
    tokens) moves a round's mean sample length far past the tolerance, so it is swapped out round after round
    until it is old or the epoch drains, and the next-shortest steps go early in its place. On chitchat_full
    (budget 4,096, W = 2) the shortest tenth trains at mean position 0.78 and the third at 0.23 (``timing``
    0.29 in evenflow.sim.composition; random batches ~0.03). Without steering every candidate step is as
    likely to go in any round (``timing`` 0.09), but a lump then lands in one quarter, and q_cv rises wherever
    a quarter holds a round or two (chitchat at budget 16,384, W = 8: 0.03 -> 0.25). The replay trained both
    and found no difference (``default_nosteer``: -0.009 on chitchat_full, +0.006 on chitchat, -0.001 on
    hh-rlhf), so the steering stays (benchmarks/results/2026-12-05_what-the-default-trains.md, fourth session).

NOTE [ Round order ]
    With one micro-batch per rank (``grad_accum_steps=1``) a round's steps run in length order, ascending in
    even rounds and descending in odd ones (a zigzag): each optimizer step is like the one before, and the
    rounds meet at the same end. Example, keys [5, 1, 3]: round 0 runs 1, 3, 5, round 1 runs 5, 3, 1.
    With accumulation they run shortest, longest, second shortest, ... so every accumulation window (k
    consecutive steps, also across a round's border) pairs short with long.
    Why: under AdamW a step unlike the one before costs. The alternation with one micro-batch per rank makes
    every step unlike the last (``rough`` ~1.7H in evenflow.sim.composition, the most its steps allow), the
    zigzag ~0.1-0.4H. The replay (budget 4,096, W = 2) trained the same steps better in the zigzag, paired by
    seed (nats/token, 95 % interval): hh_rlhf_full -0.021 [-0.031, -0.013] (16 seeds), chitchat -0.021 [-0.051,
    +0.008] (32), hh-rlhf -0.007 [-0.011, -0.002] (16); a long chitchat epoch the same, +0.002 (6)
    (benchmarks/results/2026-12-05_what-the-default-trains.md).
    Known cost: each round is a length ramp, so where a quarter of the epoch holds only a round or two the
    quarters' mean lengths differ (q_cv up to 0.18 at budget 16,384, W = 8, under ~160 steps), a proxy the
    held-out loss overrules.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EpochProgress", "band_steps", "chunks", "length_keys", "select_steps", "round_order", "systematic",
           "STEER_TOLERANCE"]

GOLDEN = 0.6180339887498949
"""Offset increment of the systematic sample: ``frac(r * GOLDEN)`` spreads any number of rounds evenly."""

STEER_TOLERANCE = 0.02
"""Steering starts when the emitted mean sample length is off its target by more than this fraction."""

STEER_PASSES = 3
"""Coordinate-descent passes over the chunks when steering (a count, not a clock)."""


@dataclass(frozen=True)
class EpochProgress:
    """What the epoch has emitted before this round: every rank of a planning group derives the same value
    from the plans (``advance``). Only composition reads it; batches stay a function of seed, configuration,
    world size and data, and a resumed loader restarts it at zero (exactly-once does not depend on it)."""

    round: int = 0
    samples: int = 0
    tokens: int = 0

    def advance(self, lengths: np.ndarray, emitted: np.ndarray) -> EpochProgress:
        """The progress after a round over the union ``lengths`` that emitted items ``emitted`` (indices)."""
        ls = np.asarray(lengths)[emitted]
        return EpochProgress(self.round + 1, self.samples + int(ls.size), self.tokens + int(ls.sum()))


def chunks(n: int, k: int) -> np.ndarray:
    """Bounds of ``k`` near-equal chunks of ``range(n)``: chunk j is ``bounds[j] .. bounds[j + 1] - 1``."""
    return np.arange(k + 1) * n // max(k, 1)


def systematic(n: int, k: int, round_index: int) -> np.ndarray:
    """One position in each of the ``k`` [`chunks()`][chunks] of ``range(n)``, at the offset of round ``round_index``:
    over rounds every position of a chunk is taken (``frac(r * GOLDEN)`` fills [0, 1) evenly).

    >>> systematic(10, 2, 0).tolist(), systematic(10, 2, 1).tolist()
    ([0, 5], [3, 8])
    """
    bounds = chunks(n, k)
    return bounds[:-1] + (((round_index * GOLDEN) % 1.0) * np.diff(bounds)).astype(np.int64)


def length_keys(lengths: np.ndarray, member: np.ndarray, group_of: np.ndarray, num_groups: int) -> np.ndarray:
    """Token-weighted mean of ``log(length)`` per group: what [`evenflow.sim.composition`][evenflow.sim.composition]
    averages per step."""
    w = np.maximum(lengths[member], 1).astype(np.float64)
    num = np.bincount(group_of, weights=w * np.log(w), minlength=num_groups)
    return num / np.maximum(np.bincount(group_of, weights=w, minlength=num_groups), 1.0)


def band_steps(times: np.ndarray, keys: np.ndarray, world: int, tolerance: float) -> np.ndarray:
    """``[C, W]`` group indices: cost bands, each dealt by length strata (NOTE [ Stratified steps ]).

    ``len(times)`` must be a multiple of ``world``. Costliest band first; within a band, steps in stratum order.

    >>> band_steps(np.full(6, 10.0), np.array([1.0, 2, 3, 4, 5, 6]), 2, 0.02).tolist()
    [[0, 5], [1, 4], [2, 3]]
    >>> band_steps(np.array([10.0, 10, 5, 5]), np.array([1.0, 2, 3, 4]), 2, 0.02).tolist()  # two bands
    [[0, 1], [2, 3]]
    """
    n = len(times)
    if n % world:
        raise ValueError(f"{n} groups do not fill steps of {world}")
    order = np.lexsort((np.arange(n), -times))
    neg = -times[order]  # ascending
    out = np.empty(n, dtype=np.int64)
    i = 0
    while i < n:
        end = int(np.searchsorted(neg, neg[i] / (1.0 + tolerance), side="right"))  # cost >= cost_i / (1 + tol)
        size = max(world, (end - i) // world * world)
        band = order[i:i + size]
        strata = band[np.lexsort((band, keys[band]))].reshape(world, size // world)
        strata[1::2] = strata[1::2, ::-1]
        out[i:i + size] = strata.T.ravel()
        i += size
    return out.reshape(-1, world)


def select_steps(stats: np.ndarray, oldest: np.ndarray, steps: int, *, progress: EpochProgress,
                 buffered: tuple[int, int], max_wait: int) -> np.ndarray:
    """Indices of the ``steps`` candidates a round emits (NOTE [ A round emits a sample of the buffer ]).

    ``stats[s]`` = (samples, real tokens) of candidate step s, ``oldest[s]`` the age of its oldest item;
    ``buffered`` = the same totals over the whole union, candidates or not. Deterministic.

    Four candidates of 100 tokens with 10, 1, 5 and 2 samples (mean lengths 10, 100, 20, 50) form the chunks
    [0, 2] and [3, 1]; round 0 takes each chunk's first, 0 and 3 (mean 200 / 12 = 16.7), but the buffer's mean
    is 400 / 18 = 22.2, so steering swaps 3 for 1 (200 / 11 = 18.2, the closest pair):

    >>> stats = np.array([[10, 100], [1, 100], [5, 100], [2, 100]])
    >>> select_steps(stats, np.zeros(4, int), 2, progress=EpochProgress(), buffered=(18, 400), max_wait=16).tolist()
    [0, 1]
    """
    c = len(stats)
    if steps >= c:
        return np.arange(c)
    count, tokens = np.asarray(stats, dtype=np.int64).T
    order = np.lexsort((np.arange(c), -oldest, tokens / np.maximum(count, 1)))  # by mean sample length
    pick = order[systematic(c, steps, progress.round)]
    bounds = chunks(c, steps)  # pick[j] lies in chunk j, and steering swaps only within it
    chunk_of = np.empty(c, dtype=np.int64)
    chunk_of[order] = np.repeat(np.arange(steps), np.diff(bounds))
    target = (progress.tokens + buffered[1]) / max(progress.samples + buffered[0], 1)

    def error(n, t):
        """Relative distance of this round's mean sample length from the target (everything seen so far)."""
        return np.abs(t / np.maximum(n, 1) / target - 1)

    forced = -1
    n_cur, t_cur = int(count[pick].sum()), int(tokens[pick].sum())
    if oldest.max() >= max_wait:  # bounded waiting: one step holding the oldest item goes
        tied = np.flatnonzero(oldest == oldest.max())
        out = pick[chunk_of[tied]]
        best = tied[int(np.argmin(error(n_cur - count[out] + count[tied], t_cur - tokens[out] + tokens[tied])))]
        forced = int(chunk_of[best])
        n_cur += int(count[best] - count[pick[forced]])
        t_cur += int(tokens[best] - tokens[pick[forced]])
        pick[forced] = best
    for _ in range(STEER_PASSES):
        moved = False
        for j in range(steps):
            if error(n_cur, t_cur) <= STEER_TOLERANCE:
                return pick
            if j == forced:
                continue
            members = order[bounds[j]:bounds[j + 1]]
            e = error(n_cur - count[pick[j]] + count[members], t_cur - tokens[pick[j]] + tokens[members])
            best = members[int(np.argmin(e))]
            if best != pick[j] and e.min() < error(n_cur, t_cur) - 1e-12:
                n_cur += int(count[best] - count[pick[j]])
                t_cur += int(tokens[best] - tokens[pick[j]])
                pick[j], moved = best, True
        if not moved:
            break
    return pick


def round_order(keys: np.ndarray, round_index: int = 0, grad_accum_steps: int = 1) -> np.ndarray:
    """Order of a round's steps by their length keys (NOTE [ Round order ]): with ``grad_accum_steps`` 1
    ascending in even rounds and descending in odd ones; with accumulation lowest, highest, second lowest, ...

    >>> keys = np.array([5.0, 1.0, 3.0, 9.0, 7.0])
    >>> round_order(keys).tolist(), round_order(keys, 1).tolist()
    ([1, 2, 0, 4, 3], [3, 4, 0, 2, 1])
    >>> round_order(keys, grad_accum_steps=2).tolist()
    [1, 3, 2, 4, 0]
    """
    srt = np.lexsort((np.arange(len(keys)), keys))
    if grad_accum_steps == 1:
        return srt[::-1] if round_index % 2 else srt
    k = len(keys)
    inter = np.empty(k, dtype=np.int64)
    inter[0::2] = srt[:(k + 1) // 2]
    inter[1::2] = srt[::-1][:k // 2]
    return inter
