"""Sharding mistakes caught at the first round: a map-style dataset split twice, iterable streams not split.

NOTE [ Sharding mistakes ]
    The loader shards a map-style dataset by index itself, so every rank must hold the *same* dataset; an
    ``IterableDataset`` is each rank's *own* stream, so ranks must read *different* ones. Both mistakes train
    silently otherwise: a map-style dataset already split per rank (``datasets.distributed.split_dataset_by_node``,
    ``Dataset.shard(num_shards=W, index=rank)``) is split again and trains 1/W of the data -- the lengths match on
    every rank, so comparing ``len()`` cannot see it; an unsplit iterable trains every sample W times.

    - Map-style: :func:`content_print` reads ``PICKS`` items at indices spread over ``len(dataset)`` (the same
      indices on every rank) twice in the main process, once per loader, when its first epoch starts on more than
      one rank: their lengths (``length_fn``, default ``len(input_ids)``) and a digest of their first
      ``HEAD_TOKENS`` token ids, each kept only where both reads agree (a ``__getitem__`` with random lengths or
      tokens fingerprints what is stable, or nothing). The result joins ``len(dataset)`` in the first exchange's
      ``data`` field, which every rank must agree on (evenflow.planning.alignment): a double split is refused on
      every rank in the first round. Cost: ``2 x PICKS`` ``__getitem__`` calls in the main process.
    - Iterable: :func:`stream_print` digests the lengths and head tokens of the first ``PICKS`` samples a rank
      buffered (at least ``MIN_STREAM``: a stream of 1-3 samples is not compared, their lengths could coincide); sent once per epoch in the first round's report (``RankReport.stream``). All ranks equal (and more
      than one rank) means identical streams: refused on every rank in the first round. Cost: none beyond
      hashing a few short token prefixes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..planning.alignment import NO_VALUE, config_fingerprint

__all__ = ["PICKS", "HEAD_TOKENS", "MIN_STREAM", "content_print", "stream_print"]

PICKS = 8
"""Items read (twice) for a map-style dataset's content fingerprint; samples digested for a stream's."""
HEAD_TOKENS = 16
"""Leading token ids of each picked item that enter its digest."""
MIN_STREAM = 4
"""Fewest buffered samples a stream fingerprint is taken from (fewer: not compared)."""


def _signature(sample: object) -> tuple[int, int] | None:
    """(number of input ids, digest of the head tokens) of one sample, or None when it is not a token sample.
    No ``length_fn``: user code that could block stays on the collation thread, where it is bounded."""
    if not isinstance(sample, Mapping) or sample.get("input_ids") is None:
        return None
    ids = sample["input_ids"]
    head = ids[:HEAD_TOKENS].numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids[:HEAD_TOKENS])
    length = len(ids)
    digest = int.from_bytes(hashlib.blake2b(np.ascontiguousarray(head, dtype=np.int64).tobytes(),
                                            digest_size=7).digest(), "little")
    return length, digest


def content_print(dataset: Sequence, limit_s: float | None = None) -> tuple:
    """Stable per-item facts of ``PICKS`` spread items (NOTE [ Sharding mistakes ]); ``()`` when none are, or
    when reading them takes longer than ``limit_s`` (a ``__getitem__`` that blocks is then met -- and named,
    under ``worker_timeout`` -- by the epoch's own stream; the reader thread is left behind, a daemon)."""
    n = len(dataset)
    picks = sorted({(k * n) // PICKS for k in range(PICKS)} - {n}) if n else []
    got: list = []

    def read() -> None:
        got.append([_signature(dataset[i]) for i in picks])
        got.append([_signature(dataset[i]) for i in picks])

    reader = threading.Thread(target=read, name="evenflow-shard-check", daemon=True)
    reader.start()
    reader.join(limit_s)
    if len(got) < 2:  # timed out, or a failing item (reported by the epoch's own stream, with its index)
        return ()
    first, again = got
    if any(s is None for s in first + again):
        return ()
    lengths = tuple(a[0] for a in first) if all(a[0] == b[0] for a, b in zip(first, again)) else None
    digests = tuple(a[1] for a in first) if first == again else None
    return (lengths, digests) if lengths is not None or digests is not None else ()


def stream_print(samples: Sequence[object]) -> int:
    """Fingerprint of a rank's first buffered samples (lengths and head tokens); NO_VALUE with fewer than
    ``MIN_STREAM`` (a short stream's few samples could coincide across ranks by chance)."""
    try:  # runs inside the round's report: it must never raise (a peer would wait for this rank)
        signatures = [_signature(s) for s in samples[:PICKS]]
    except Exception:  # noqa: BLE001 - an odd sample is measured (and reported) by the loader itself
        return NO_VALUE
    if len(signatures) < MIN_STREAM or any(s is None for s in signatures):
        return NO_VALUE
    return config_fingerprint(tuple(signatures))
