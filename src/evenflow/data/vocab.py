"""Dense vocabulary remap: keep the token ids a dataset uses, renumbered ``0..k-1``. Lengths stay real.

Why: Qwen3's 151,669-token vocabulary makes the embedding and output layer dominate a tiny model on CPU
(a 4,096-token batch has ~2.5 GB of fp32 logits). A corpus of 1,000 chats uses ~10k distinct ids; mapping
them to a dense range shrinks the output layer 15x while every sample keeps its exact token count, so the
batching, padding and balancing the demo measures are unchanged.

Example: ids ``[151644, 872, 198]`` seen in the data -> ``{198: 1, 872: 2, 151644: 3}``. Dense id 0 is ``unk``:
ids absent when the remap was built (held-out text) or beyond ``max_size``. Labels keep ``-100``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .chat import IGNORE_INDEX

__all__ = ["VocabRemap", "RemappedDataset"]

UNK_ID = 0
"""Dense id of every original id the remap has not seen."""


class VocabRemap:
    """Original id -> dense id via a lookup table (int32, one entry per original id)."""

    def __init__(self, used_ids: Iterable[int] | np.ndarray, *, full_vocab_size: int) -> None:
        used = np.unique(np.asarray(used_ids if isinstance(used_ids, np.ndarray) else list(used_ids),
                                    dtype=np.int64))
        if used.size and (used.min() < 0 or used.max() >= full_vocab_size):
            raise ValueError(f"token ids must lie in [0, {full_vocab_size}), got range [{used.min()}, {used.max()}]")
        self.full_vocab_size = int(full_vocab_size)
        self.original_ids = used
        """Sorted original ids; ``original_ids[d - 1]`` is the id behind dense id ``d``."""
        self.table = np.full(full_vocab_size, UNK_ID, dtype=np.int32)
        self.table[used] = np.arange(1, used.size + 1, dtype=np.int32)

    @classmethod
    def from_dataset(cls, dataset: Any, *, full_vocab_size: int, max_size: int | None = None,
                     extra_ids: Iterable[int] = ()) -> VocabRemap:
        """Build from every ``input_ids`` of a map-style dataset (one pass through its real pipeline)."""
        counts = np.zeros(full_vocab_size, dtype=np.int64)
        for i in range(len(dataset)):
            counts += np.bincount(np.asarray(dataset[i]["input_ids"], dtype=np.int64), minlength=full_vocab_size)
        return cls.from_counts(counts, max_size=max_size, extra_ids=extra_ids)

    @classmethod
    def from_counts(cls, counts: np.ndarray, *, max_size: int | None = None,
                    extra_ids: Iterable[int] = ()) -> VocabRemap:
        """Build from per-id occurrence counts (``counts[id]``; its length is the full vocabulary size).

        ``max_size`` caps [`size`][size] (``unk`` included): the ``max_size - 1`` most frequent ids are kept (ties
        broken by smaller id), ``extra_ids`` always; the rest become ``unk``. On 1,000 chitchat chats the top
        4,095 ids cover ~95 % of tokens. ``None`` keeps every id seen.

        >>> VocabRemap.from_counts(np.array([0, 5, 1, 7]), max_size=3).original_ids.tolist()
        [1, 3]
        """
        if max_size is not None and max_size < 2:
            raise ValueError(f"max_size must be >= 2 (unk + one token) or None, got {max_size}")
        counts = np.asarray(counts, dtype=np.int64)
        forced = np.unique(np.asarray(list(extra_ids), dtype=np.int64))
        seen = np.flatnonzero(counts)
        if max_size is not None and np.union1d(seen, forced).size >= max_size:
            room = max(max_size - 1 - forced.size, 0)
            rest = seen[~np.isin(seen, forced)]
            # Stable sort on -count keeps the id order among ties.
            seen = rest[np.argsort(-counts[rest], kind="stable")[:room]]
        return cls(np.concatenate([seen, forced]), full_vocab_size=counts.size)

    @property
    def size(self) -> int:
        """Dense vocabulary size, ``unk`` included: the model's ``vocab_size``."""
        return int(self.original_ids.size + 1)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Remap ids; ``IGNORE_INDEX`` entries (labels) stay ``IGNORE_INDEX``."""
        arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        keep = arr != IGNORE_INDEX
        out = np.full(arr.shape, IGNORE_INDEX, dtype=np.int64)
        out[keep] = self.table[arr[keep]]
        return torch.from_numpy(out)


class RemappedDataset(torch.utils.data.Dataset):
    """Wrap a dataset and remap its ``input_ids`` and ``labels``; other keys pass through."""

    KEYS = ("input_ids", "labels")

    def __init__(self, dataset: Any, remap: VocabRemap) -> None:
        self.dataset = dataset
        self.remap = remap

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Mapping[str, Any]:
        sample = dict(self.dataset[index])
        for key in self.KEYS:
            if key in sample:
                sample[key] = self.remap(sample[key])
        return sample
