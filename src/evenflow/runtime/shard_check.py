"""Sharding mistakes caught in an epoch's first rounds: a map-style dataset split twice, iterable streams not split.

NOTE [ Sharding mistakes ]
    The loader shards a map-style dataset by index itself, so every rank must hold the *same* dataset; an
    ``IterableDataset`` is each rank's *own* stream, so ranks must read *different* ones. Both mistakes train
    silently otherwise: a map-style dataset already split per rank (``datasets.distributed.split_dataset_by_node``,
    ``Dataset.shard(num_shards=W, index=rank)``) is split again and trains 1/W of the data -- its length matches
    on every rank, and so may the lengths and first tokens of its items (samples padded to a fixed length after a
    shared system prompt); an unsplit iterable, each rank shuffling it with its own seed, trains every sample W
    times. What is compared is a sample's *token content*: ``input_ids`` and ``labels``, digested in full
    ([`token_digest()`][token_digest]); other keys (pixel values, audio features) may change between reads or by rank.

    - Map-style ([`content_print()`][content_print]): ``PICKS`` items at indices spread over ``len(dataset)`` (the same
      indices on every rank) are read twice in the main process, once per loader. Token content that changes between the
      two reads (a random crop or truncation, a random prompt) cannot be compared: the rank refuses the epoch in
      its first round, naming ``shard_check=False`` (a split dataset with random crops is refused the same way).
      Otherwise the digests join ``len(dataset)`` in the first exchange's ``content`` field, which every rank
      must agree on (evenflow.planning.alignment): a dataset split per rank is refused on every rank in the first
      round, whatever its padding or shared prompt. A whole dataset whose augmentation is seeded by (rank, index)
      and changes token ids cannot be told from a split one by its content: refused too, naming the flag.
      A check that cannot run is never a pass: ``worker_timeout`` bounds *each* read (slow storage makes the
      check slower, not skipped), and a read past it, or one that raises, refuses the epoch on every rank
      naming the item, the bound and the flag (refused rather than warned: the epoch would meet the same read
      under the same bound). Items without integer ``input_ids`` (tokenized by ``collate_fn``) leave nothing
      to compare: every rank warns, naming the flag that silences it.
      Cost: ``2 x PICKS`` ``__getitem__`` calls and their digests, once per loader.
    - Iterable (evenflow.runtime.stream_check): each rank digests the first ``window`` samples of its stream
      (``buffer_size``, at most ``MAX_WINDOW``); once every rank has them (or ran dry) -- the first round when
      the buffer fills, a later one when the warm-up starts rounds earlier -- the ranks gather them once per
      loader (a bottom-k sketch above ``FULL_WORLD`` ranks) and count identical samples *across* ranks
      (X, pairs of copies on two ranks) and *within* ranks (Y). Streams split per rank share only natural
      repeats, and a repeated sample's copies land on two ranks (W - 1) times as often as on one, so X is about
      (W - 1) Y; unsplit streams share every sample, X >> Y (neighbours that an interleaved split deals to
      two ranks are taken out of X: NOTE [ Neighbours dealt apart ] in stream_check.py). Refused when X >=
      ``MIN_SHARED``, X >= ``RATIO`` (W - 1) Y, and the binomial tail P[Bin(X + Y, (W - 1) / W) >= X] <= ``ALPHA`` (the
      chance that split streams' repeats fall this unevenly). Unsplit streams of N samples share about C(W, 2) window^2
      / N: at W = 2, window = 4,096, N = 1M that is 16.8 pairs, refused with probability 99.8 % (measured: 99 of 100
      seeds; every seed at N <= 100K or W >= 4); larger streams slip through (W = 2: 34 of 100 missed at 2M, 84
      at 4M). Split streams whose samples repeat 5 % within each stream share nothing: 0 refusals; when the data
      set's repeats are dealt across ranks they do share, and the rule refuses at most ~0.3 % of seeds at its
      worst N (measured: benchmarks/loader/shard_check_sim.py, on digests, docs/mistakes.md). Cost: one
      digest per sample of the window (~55 us for 840 tokens), one all_gather of window int64 per rank, once
      per loader (benchmarks/bench_shard_check.py).

    ``shard_check=False`` turns both checks off (the loader's argument; it is not part of the configuration
    fingerprint: a state saved with either value resumes with the other).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..planning.alignment import NO_VALUE, config_fingerprint

__all__ = ["PICKS", "TOKEN_KEYS", "token_digest", "ContentPrint", "content_print"]

PICKS = 8
"""Items read (twice) for a map-style dataset's content fingerprint; stream samples in a resume fingerprint."""
TOKEN_KEYS = ("input_ids", "labels")
"""The keys whose content is digested: what the model trains on, unlike media that augmentation may change."""


def token_digest(sample: object) -> int | None:
    """A 62-bit digest of ``input_ids`` and ``labels`` in full (values and shapes, as int64), or None when the
    sample is not a mapping with integer ``input_ids``. Two samples digest alike iff they train the same tokens.
    Never raises: it runs on every sample of a stream's window, and a bad sample is the loader's to report."""
    if not isinstance(sample, Mapping) or sample.get("input_ids") is None:
        return None
    h = hashlib.blake2b(digest_size=8)
    try:
        for key in TOKEN_KEYS:
            value = sample.get(key)
            if value is None:
                h.update(b"-")
                continue
            if isinstance(value, torch.Tensor):
                plain = value.device.type == "cpu" and not value.requires_grad
                value = value.numpy() if plain else value.detach().cpu().numpy()
            arr = np.ascontiguousarray(value, dtype=np.int64)  # no copy for int64 token ids
            h.update(repr(arr.shape).encode())
            h.update(arr.data)
    except Exception:  # noqa: BLE001 - ragged, nested, non-numeric: measured (and named) by the loader itself
        return None
    return int.from_bytes(h.digest(), "little") >> 2


# -- map-style ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContentPrint:
    """What a few items of a map-style dataset say about its content (NOTE [ Sharding mistakes ])."""

    value: int | None
    """Fingerprint of the picked items' token digests; None when they cannot be compared."""
    unstable: tuple[int, ...] = ()
    """Indices whose token content changed between two reads."""
    unread: str = ""
    """Why the check could not read its items: one read ran past ``worker_timeout``, or raised."""
    untokened: bool = False
    """The items are not token samples (no integer ``input_ids``): there is nothing to compare."""

    def error(self, rank: int) -> ValueError | None:
        """The refusal of a dataset whose token ids change between reads, or whose items the check could not
        read (None when neither)."""
        if self.unread:
            return ValueError(
                f"evenflow: rank {rank}: the sharding check could not read the dataset: {self.unread}. It reads "
                f"{PICKS} items twice to refuse a dataset already split per rank (datasets.distributed."
                "split_dataset_by_node, Dataset.shard), which would be split again and train 1/W of the data, and "
                "an unread check is not a pass. Make the item readable, raise worker_timeout= if a read is "
                "legitimately this slow, or pass shard_check=False if every rank holds the whole dataset")
        if not self.unstable:
            return None
        return ValueError(
            f"evenflow: rank {rank}: the dataset's token ids change between reads (item(s) {list(self.unstable)} read "
            "twice in a row gave different input_ids/labels: a random crop or truncation, a random prompt). The "
            "loader compares the token content of a few items across ranks to refuse a dataset already split per "
            "rank (datasets.distributed.split_dataset_by_node, Dataset.shard), which would be split again and train "
            "1/W of the data; content that changes on every read cannot be compared. If every rank holds the whole "
            "dataset, pass shard_check=False (or seed the augmentation by (seed, epoch, index), the same on every "
            "rank); if it is split per rank, pass the whole dataset: the loader shards it by index")

    def warning(self, rank: int) -> str | None:
        """What to warn when the items are not token samples, so the check compares nothing (None otherwise)."""
        if not self.untokened:
            return None
        return (f"evenflow: rank {rank}: the sharding check cannot compare this dataset: its items have no integer "
                "input_ids (tokenized later, by collate_fn?), so a dataset already split per rank "
                "(split_dataset_by_node, Dataset.shard) would not be refused and would train 1/W of the data. "
                "Pass the whole dataset on every rank; shard_check=False silences this warning")

    @property
    def compared(self) -> int:
        """The report's ``content`` field: the fingerprint, or NO_VALUE (not compared)."""
        return NO_VALUE if self.value is None else self.value


_READ_POLL_S = 0.05


def content_print(dataset: Sequence, limit_s: float | None = None) -> ContentPrint:
    """Token digests of ``PICKS`` spread items, each read twice (NOTE [ Sharding mistakes ]). ``limit_s`` bounds
    *each* read (``worker_timeout``, like the epoch's own calls), not their sum: slow storage makes the check
    slow, never skipped. A read past it, or one that raises, leaves the check unread
    ([`ContentPrint.error()`][ContentPrint.error] refuses the epoch); the reader thread is then left behind, a
    daemon."""
    n = len(dataset)
    picks = sorted({(k * n) // PICKS for k in range(PICKS)} - {n}) if n else []
    got: list = []
    reading = [time.monotonic(), None]  # when the current read started, and its index
    failed: list[str] = []
    done = threading.Event()

    def read() -> None:
        try:
            for _ in range(2):
                row = []
                for i in picks:
                    reading[:] = [time.monotonic(), i]
                    row.append(token_digest(dataset[i]))
                got.append(row)
        except Exception as exc:  # noqa: BLE001 - named in the refusal
            failed.append(f"reading item {reading[1]} raised {type(exc).__name__}: {exc}"[:500])
        finally:
            done.set()

    reader = threading.Thread(target=read, name="evenflow-shard-check", daemon=True)
    reader.start()
    while not done.wait(_READ_POLL_S):
        started, index = reading
        if limit_s is not None and time.monotonic() - started > limit_s:
            return ContentPrint(None, unread=f"reading item {index} took longer than worker_timeout={limit_s:g}s")
    if failed:
        return ContentPrint(None, unread=failed[0])
    if not picks:
        return ContentPrint(None)
    first, again = got
    if any(d is None for d in first + again):
        return ContentPrint(None, untokened=True)
    unstable = tuple(i for i, a, b in zip(picks, first, again) if a != b)
    if unstable:
        return ContentPrint(None, unstable)
    return ContentPrint(config_fingerprint("tokens", tuple(first)))
