"""Per-rank sample streams built on a plain public ``torch.utils.data.DataLoader`` (batch_size=None).

Map-style datasets are sharded by the loader: a seeded permutation of all indices, dealt round-robin to
ranks, with *no padding duplicates* (601 samples on 3 ranks -> 201/200/200). Iterable datasets are each
rank's own stream; the key of a sample is its position in that stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

__all__ = ["shard_indices", "StreamOptions", "Streams"]


def shard_indices(num_samples: int, *, rank: int, world_size: int, epoch: int, seed: int,
                  shuffle: bool) -> list[int]:
    """This rank's indices for ``epoch``: deterministic, disjoint across ranks, covering every index once.

    >>> shard_indices(5, rank=1, world_size=2, epoch=0, seed=0, shuffle=False)
    [1, 3]
    """
    order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
             else np.arange(num_samples))
    return order[rank::world_size].tolist()


class _IndexList(Sampler[int]):
    """A sampler over an explicit index list (reset per epoch; persistent workers see the new list)."""

    def __init__(self) -> None:
        self.indices: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class _WithIndex(Dataset):
    """Return ``(index, sample)`` so the stream knows which dataset index each sample came from."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int):
        return index, self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)


def _identity(x):
    return x


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """What is passed straight to the worker ``DataLoader``; see ``torch.utils.data.DataLoader``."""

    num_workers: int = 0
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False
    multiprocessing_context: object = None
    worker_init_fn: object = None
    timeout: float = 0


class Streams:
    """Owns the worker DataLoader and hands out one ``(key, sample)`` iterator per epoch."""

    def __init__(self, dataset: Dataset, options: StreamOptions) -> None:
        self.iterable = isinstance(dataset, IterableDataset)
        self.dataset = dataset
        kwargs = dict(batch_size=None, collate_fn=_identity, num_workers=options.num_workers,
                      persistent_workers=options.persistent_workers and options.num_workers > 0,
                      pin_memory=options.pin_memory, multiprocessing_context=options.multiprocessing_context,
                      worker_init_fn=options.worker_init_fn, timeout=options.timeout)
        if options.num_workers > 0 and options.prefetch_factor is not None:
            kwargs["prefetch_factor"] = options.prefetch_factor
        if self.iterable:
            self.sampler = None
            self.loader = DataLoader(dataset, **kwargs)
        else:
            self.sampler = _IndexList()
            self.loader = DataLoader(_WithIndex(dataset), sampler=self.sampler, **kwargs)

    def open(self, indices: Sequence[int] | None = None) -> Iterator:
        """Start the epoch's workers now (on the calling thread) and return the stream: ``(index, sample)``
        pairs for map-style datasets, raw samples for iterable ones (the loader numbers them)."""
        if self.iterable:
            return iter(self.loader)
        self.sampler.indices = list(indices)
        return iter(self.loader)

