"""The unsplit-stream check: each rank's first samples digested, gathered once, judged (NOTE [ Sharding mistakes ]
in evenflow.runtime.shard_check, which also holds the digest and the map-style check).

An ``IterableDataset`` is each rank's own stream. Unsplit streams that each rank shuffles its own way share no
order, only samples: the ranks compare the token digests of their first ``window`` samples, counting identical
samples across ranks (X) against those within a rank (Y), which is what split streams' natural repeats predict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np

from ..planning.alignment import NO_VALUE, RankReport, config_fingerprint
from .shard_check import PICKS, token_digest

__all__ = ["MAX_WINDOW", "FULL_WORLD", "MIN_SKETCH", "MIN_SHARED", "RATIO", "ALPHA", "POS_BITS", "NEIGHBOUR_SHARE",
           "NEIGHBOUR_MOST", "NEIGHBOUR_ALPHA", "window_size", "StreamWindow", "sketch_width", "sketch", "shared_pairs",
           "neighbour_pairs", "stream_verdict", "StreamCheck"]

MAX_WINDOW = 4096
"""Most samples per rank an iterable stream check digests and gathers (its window is ``min(buffer_size, this)``)."""
FULL_WORLD = 8
"""Up to this many ranks every digest of the window is gathered; above it a bottom-k sketch of
``max(MIN_SKETCH, window * FULL_WORLD // W)`` digests per rank, so the gathered bytes stay ~``FULL_WORLD`` windows."""
MIN_SKETCH = 64
"""Fewest digests per rank in a sketch (worlds of more than ``FULL_WORLD * MAX_WINDOW / MIN_SKETCH`` = 512 ranks)."""
MIN_SHARED = 7
"""Fewest cross-rank pairs of identical samples that refuse a stream (X)."""
RATIO = 5
"""X must be at least this many times what split streams' own repeats predict, (W - 1) Y: with many repeats
(small data sets, or samples that share content) the binomial tail alone would refuse on a small imbalance.
Unsplit streams whose samples repeat a fraction f show X / ((W - 1) Y) ~ (1 + 2f) / 2f: still refused up to
f ~ 11 %."""
ALPHA = 0.008
"""Refuse when split streams would show this many cross-rank pairs with at most this probability. At W = 2 with
no repeat within ranks it takes 7 cross-rank pairs (2^-7 = 0.0078): unsplit streams of 1M samples show 16.8
on average, fewer than 7 in 0.24 % of cases."""

POS_BITS = 12
"""A gathered value is the low 50 bits of a sample's 62-bit digest, shifted up by ``POS_BITS`` and tagged with its
position in the rank's window (NOTE [ Neighbours dealt apart ]); 50 bits still tell samples apart."""
_IDENT_MASK = (1 << (62 - POS_BITS)) - 1
NEIGHBOUR_SHARE = 0.75
"""Neighbour pairs explain cross-rank pairs only while they involve at most this share of the gathered samples:
an interleaved split of a stream whose pages repeat in a row (up to half of them: 2/3 of its samples) stays under it;
identical streams (every sample paired with its twin on the next rank) are at 1."""
NEIGHBOUR_MOST = 0.8
"""Neighbour pairs explain cross-rank pairs only when they are at least this share of them: in an interleaved
split of a stream with repeats in a row nearly every cross-rank pair is one; in unsplit streams shuffled by rank
few are (2 in 7 by chance in a stream of 7 samples, ~0 in a long one), and those stay counted."""
NEIGHBOUR_ALPHA = 1e-6
"""Neighbour pairs explain cross-rank pairs only while their earlier copies' ranks look dealt at random: refused
as an explanation when a skew this unlikely shows (identical streams: the earlier copy is always the lower rank;
streams rotated by one sample: always the higher). Small, because the binomial law understates the spread of a
real crawl's: where one repeat falls shifts the next one's rank (at 1e-3, 2 of 200 simulated crawls at W = 2
were refused)."""
assert MAX_WINDOW <= 1 << POS_BITS

_STREAM_COL = [f.name for f in fields(RankReport)].index("stream")
_EXHAUSTED_COL = [f.name for f in fields(RankReport)].index("exhausted")
_NO_DIGEST = -2
"""A window sample without token content (not a mapping, no input_ids): counted, never matched."""


def window_size(buffer_size: int) -> int:
    """Samples per rank an iterable stream check digests: ``buffer_size``, at most ``MAX_WINDOW``."""
    return min(int(buffer_size), MAX_WINDOW)


class StreamWindow:
    """Token digests of the first samples of one rank's epoch stream, fed by the loader as samples arrive.

    ``size``: samples the stream check digests (0: none). The first ``PICKS`` are always kept: they fingerprint
    the stream in a saved state ([`head()`][head]), and a resumed epoch's re-read must match ``expected_head``.
    """

    def __init__(self, size: int, *, expected_head: int | None = None, rank: int = 0) -> None:
        self.size = size
        self.digests: list[int] = []
        self.seen = 0
        self.expected_head = expected_head
        """The saved state's [`head()`][head]: this epoch resumes mid-way and must re-read the same first samples."""
        self.rank = rank

    def add(self, sample: object) -> None:
        """One more sample of the stream, in stream order (called on the thread that reads the stream)."""
        if self.seen < max(self.size, PICKS):
            digest = token_digest(sample)
            self.digests.append(_NO_DIGEST if digest is None else digest)
        self.seen += 1
        if self.seen == PICKS:
            self._verify()

    def end(self) -> None:
        """The stream ran dry: a resumed one shorter than ``PICKS`` is verified here."""
        if self.seen < PICKS:
            self._verify()

    def head(self) -> int | None:
        """Fingerprint of the stream's first ``PICKS`` samples (None: fewer, or not token samples)."""
        first = self.digests[:PICKS]
        if len(first) < PICKS or _NO_DIGEST in first:
            return None
        return config_fingerprint("stream", tuple(first))

    def fingerprint(self) -> int | None:
        """What a state saved now records (``content``): [`head()`][head], or the resumed state's while its re-read
        has not reached it yet (a state saved again right after a resume keeps the stream's fingerprint)."""
        return self.expected_head if self.expected_head is not None else self.head()

    def _verify(self) -> None:
        expected, self.expected_head = self.expected_head, None
        if expected is None:
            return
        now = self.head()
        if now != expected:
            found = f"digest to {now}" if now is not None else "are fewer, or not token samples"
            raise ValueError(
                f"evenflow: rank {self.rank} cannot resume this IterableDataset: the state was saved on a stream "
                f"whose first {PICKS} samples digest to {expected}, and this one's {found}; a resumed epoch re-reads "
                "its stream and skips the samples trained before, so a different stream (another dataset, order, seed "
                "or rank) would lose some samples and repeat others. Resume with the stream the state was saved "
                "with, or start the epoch afresh: loader.set_epoch(epoch, discard_resumed=True)")

    def sketch(self, world: int) -> np.ndarray:
        """This rank's row of the stream check's exchange ([`sketch()`][sketch])."""
        return sketch(self.digests[:self.size], self.size, world)


def sketch_width(window: int, world: int) -> int:
    """Digests per rank in the stream check's exchange (all of the window up to ``FULL_WORLD`` ranks)."""
    return window if world <= FULL_WORLD else min(window, max(MIN_SKETCH, window * FULL_WORLD // world))


def sketch(digests: Sequence[int], window: int, world: int) -> np.ndarray:
    """The row a rank sends: its window's digests (repeats kept), each tagged with its position in the window
    (``POS_BITS``), the ``sketch_width`` smallest, sorted, padded with NO_VALUE. Keeping the smallest
    values is a consistent sample: a digest kept on one rank is kept on every rank that holds it and kept as many
    (up to the ranks' thresholds), so shared samples stay shared."""
    width = sketch_width(window, world)
    arr = np.asarray(digests, dtype=np.int64).reshape(-1)
    pos = np.arange(len(arr), dtype=np.int64)
    keep = arr >= 0
    tagged = ((arr[keep] & _IDENT_MASK) << POS_BITS) | pos[keep]
    arr = np.sort(tagged)[:width]
    row = np.full(width, NO_VALUE, dtype=np.int64)
    row[:len(arr)] = arr
    return row


def shared_pairs(table: np.ndarray) -> tuple[int, int]:
    """(X, Y) of gathered sketches ``[world, width]``: pairs of identical samples on two different ranks, and on
    one rank. A sample held m_r times on rank r gives sum_{r<s} m_r m_s cross pairs and sum_r C(m_r, 2) within."""
    ranks = np.repeat(np.arange(table.shape[0]), table.shape[1])
    values = table.ravel()
    keep = values >= 0
    ranks, values = ranks[keep], values[keep]
    if not len(values):
        return 0, 0
    _, per_value = np.unique(values, return_inverse=True)
    pair_ids = per_value.astype(np.int64) * table.shape[0] + ranks
    _, m = np.unique(pair_ids, return_counts=True)  # multiplicity of each (sample, rank)
    _, total = np.unique(per_value, return_counts=True)  # multiplicity of each sample over all ranks
    within = int((m * (m - 1) // 2).sum())
    all_pairs = int((total * (total - 1) // 2).sum())
    return all_pairs - within, within


def _per_rank(table: np.ndarray, most: int = 4) -> str:
    """``"rank 0: 96 of its 96 samples are on another rank too; ..."`` for the ranks that share the most."""
    pairs = np.stack([np.repeat(np.arange(table.shape[0]), table.shape[1]), table.ravel()], 1)
    distinct = np.unique(pairs[table.ravel() >= 0], axis=0)
    ranks, digests = distinct[:, 0], distinct[:, 1]  # each (rank, digest) once
    _, inverse, holders = np.unique(digests, return_inverse=True, return_counts=True)
    shared = np.bincount(ranks, weights=holders[inverse] > 1, minlength=table.shape[0]).astype(int)
    total = np.bincount(ranks, minlength=table.shape[0])
    order = np.argsort(-shared, kind="stable")[:most]
    return "; ".join(f"rank {r}: {shared[r]} of its {total[r]} samples are on another rank too" for r in order)


def _binomial_tail(x: int, n: int, q: float) -> float:
    """P[Bin(n, q) >= x]."""
    from scipy.stats import binom  # only when a stream shows enough shared samples to be judged

    return float(binom.sf(x - 1, n, q))


# NOTE [ Neighbours dealt apart ]
#     The count X of cross-rank pairs assumes a repeated sample's copies land on ranks at random. An interleaved
#     split (datasets.distributed.split_dataset_by_node when the shards do not divide by W, an __iter__ that keeps
#     every W-th sample) deals *neighbours* to different ranks every time: a crawl that saw a page twice in a
#     row puts one copy on each of two ranks, and split streams then share as many samples as unsplit ones. So
#     every gathered value carries its position p in its rank's window, and the ranks rebuild the interleaved
#     order g = p W + r. Copies of a sample that are neighbours there (consecutive copies less than W apart, on
#     two ranks) are what an interleaved split of a stream with adjacent repeats shows; they are taken out of X
#     when they explain it honestly: they are most of X (NEIGHBOUR_MOST), involve at most NEIGHBOUR_SHARE of
#     the samples, and the rank holding the earlier copy is spread over the ranks as a random position would
#     spread it (NEIGHBOUR_ALPHA).
#     Unsplit streams fail that: identical ones pair every sample with its twin, the earlier copy always on the
#     lower rank; a stream rotated by one sample per rank, always on the higher; rank-shuffled ones have almost
#     no neighbour pairs to take out. A stream repeated for several passes and then split puts its copies a pass
#     apart, not side by side: by content it is an unsplit stream rotated by half a pass, and stays refused.
def neighbour_pairs(table: np.ndarray, world: int) -> tuple[int, float, float]:
    """(pairs, share, p) of gathered tagged sketches ``[world, width]``: copies of a sample that are neighbours in
    the interleaved order (NOTE [ Neighbours dealt apart ]), the share of gathered samples they involve, and the
    chance that random positions spread the earlier copies' ranks at least this unevenly."""
    ranks = np.repeat(np.arange(table.shape[0], dtype=np.int64), table.shape[1])
    values = table.ravel()
    keep = values >= 0
    ranks, values = ranks[keep], values[keep]
    if len(values) < 2:
        return 0, 0.0, 1.0
    ident, g = values >> POS_BITS, (values & ((1 << POS_BITS) - 1)) * world + ranks
    order = np.lexsort((g, ident))
    ident, g, ranks = ident[order], g[order], ranks[order]
    near = (ident[1:] == ident[:-1]) & (ranks[1:] != ranks[:-1]) & (g[1:] - g[:-1] < world)
    pairs = int(near.sum())
    if not pairs:
        return 0, 0.0, 1.0
    involved = np.zeros(len(g), dtype=bool)
    involved[1:] |= near
    involved[:-1] |= near
    counts = np.bincount(g[:-1][near] % world, minlength=world)
    from scipy.stats import binom  # only when neighbours are shared

    q = 1.0 / world
    p = world * (binom.sf(int(counts.max()) - 1, pairs, q) + binom.cdf(int(counts.min()), pairs, q))
    return pairs, float(involved.mean()), float(min(1.0, p))


def stream_verdict(table: np.ndarray, world: int) -> str | None:
    """The refusal of unsplit streams from the gathered sketches (NOTE [ Sharding mistakes ]), or None."""
    if world < 2:
        return None
    ident = np.where(table >= 0, table >> POS_BITS, NO_VALUE)
    cross, within = shared_pairs(ident)
    if cross < MIN_SHARED:
        return None
    near, share, p_near = neighbour_pairs(table, world)
    if near >= NEIGHBOUR_MOST * cross and share <= NEIGHBOUR_SHARE and p_near > NEIGHBOUR_ALPHA:
        cross -= near  # neighbours dealt apart by an interleaved split (NOTE [ Neighbours dealt apart ])
    if cross < MIN_SHARED or cross < RATIO * (world - 1) * within:
        return None
    p = _binomial_tail(cross, cross + within, (world - 1) / world)
    if p > ALPHA:
        return None
    kept = int((table >= 0).sum(axis=1).max())
    return (f"evenflow: the ranks' IterableDataset streams overlap: among the first {kept} samples each rank read, "
            f"{cross} pairs of identical samples (same input_ids and labels) sit on two different ranks, against "
            f"{within} pairs within a rank ({_per_rank(ident)}). Streams split per rank share only natural repeats, "
            f"about {world - 1}x those within a rank; this many means the ranks read the same samples (each "
            f"shuffling them its own way, perhaps), which trains every sample up to {world} times (chance of this "
            f"from split streams: p = {p:.1g}; NOTE [ Sharding mistakes ] in evenflow.runtime.shard_check). Split the "
            "stream per rank (an HF IterableDataset: datasets.distributed.split_dataset_by_node(ds, rank=rank, "
            "world_size=world_size); your own: skip by rank in __iter__), or pass a map-style dataset (the loader "
            "shards it by index). A stream that repeats its data for several passes before it is split deals each "
            "sample's copies to different ranks just the same: stream one pass per epoch and call "
            "loader.set_epoch(epoch) for the next. If the overlap is intended, pass shard_check=False")


class StreamCheck:
    """The iterable stream check of one loader: run once, in the first round every rank's window is complete.

    The collation thread calls [`reported()`][reported] for its round report's ``stream`` field and [`after()`][after]
    once the round's reports are gathered; both depend only on what every rank sees, so every rank gathers the sketches
    in the same round, or none does (a rank without the check reports NO_VALUE: then no rank gathers).
    """

    def __init__(self, window: int, world: int) -> None:
        self.window = window
        self.world = world
        self.current = StreamWindow(window)
        self.done = False
        """The check ran (on every rank in the same round): later epochs report NO_VALUE."""

    def epoch(self, window: StreamWindow) -> None:
        self.current = window

    def reported(self) -> int:
        """The report's ``stream`` field: digests ready (capped at the window), or NO_VALUE once checked."""
        return NO_VALUE if self.done else min(self.current.seen, self.window)

    def after(self, table: np.ndarray, exchange) -> ValueError | None:
        """Gather and judge the sketches when the gathered reports say every window is complete: the refusal of
        unsplit streams (the same on every rank), or None."""
        if self.done:
            return None
        counts, exhausted = table[:, _STREAM_COL], table[:, _EXHAUSTED_COL]
        if (counts < 0).any() or not ((counts >= self.window) | (exhausted != 0)).all():
            return None
        self.done = True
        gathered = exchange.all_gather(self.current.sketch(self.world))
        message = stream_verdict(gathered, self.world)
        return None if message is None else ValueError(message)
