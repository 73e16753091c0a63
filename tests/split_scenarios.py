"""Split data the sharding checks must accept, and unsplit data they must refuse, on real gloo ranks
(tests/_dist.run_world; NOTE [ Sharding mistakes ] and NOTE [ Neighbours dealt apart ]). Each scenario returns
what its rank trained (the ``pos`` tags) or the error that ended the epoch."""

from __future__ import annotations

import time
import traceback
from datetime import timedelta

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

import evenflow


def _row(pos: int, content: int) -> dict:
    n = 4 + content % 29
    return {"input_ids": torch.tensor([content % 30_000 + 1] * n), "pos": pos}


def crawl(n: int, dup: float = 0.3, seed: int = 0) -> list[dict]:
    """A crawl that saw ``dup`` of its pages twice in a row: adjacent exact duplicates, each tagged by position."""
    rng = np.random.default_rng(seed)
    contents = np.repeat(np.arange(n), 1 + (rng.random(n) < dup))
    return [_row(p, int(c)) for p, c in enumerate(contents)]


class Interleaved(IterableDataset):
    """Sample i of the stream to rank i mod W (what split_dataset_by_node does when shards do not divide by W)."""

    def __init__(self, rows, rank, world):
        self.rows, self.rank, self.world = rows, rank, world

    def __iter__(self):
        return iter(self.rows[self.rank::self.world])


class Rotated(IterableDataset):
    """Every rank reads the whole stream, rank r starting ``r * k`` samples in."""

    def __init__(self, rows, rank, k):
        self.rows, self.start = rows, rank * k

    def __iter__(self):
        return iter(self.rows[self.start:] + self.rows[:self.start])


class Slow(Dataset):
    """Items that take ``seconds`` to read (a cold cache, remote storage); ``stuck``: this index takes 30 s."""

    def __init__(self, rows, seconds, stuck=None):
        self.rows, self.seconds, self.stuck = rows, seconds, stuck

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        time.sleep(30 if i == self.stuck else self.seconds)
        return self.rows[i]


def _record(loader) -> dict:
    out = {"type": None, "text": "", "pos": []}
    try:
        with loader:
            for batch in loader:
                if not evenflow.pop_step_info(batch).is_idle:
                    out["pos"].extend(int(p) for p in batch["pos"])
    except Exception as exc:  # noqa: BLE001 - the scenario's outcome
        out.update(type=type(exc).__name__, text="".join(traceback.format_exception(exc))[-4000:])
    return out


def _loader(ds, **kw):
    return evenflow.DynamicBatchLoader(ds, **({"token_budget": 512, "timeout": timedelta(seconds=60),
                                               "buffer_size": 512} | kw))


def sc_neighbours(rank, world):
    return _record(_loader(Interleaved(crawl(240), rank, world)))


def sc_neighbours_hf(rank, world):
    from datasets import IterableDataset as HFIterable
    from datasets.distributed import split_dataset_by_node

    rows = [{"input_ids": r["input_ids"].tolist(), "pos": r["pos"]} for r in crawl(240, seed=1)]
    ds = HFIterable.from_generator(lambda: iter(rows)).with_format("torch")
    return _record(_loader(split_dataset_by_node(ds, rank=rank, world_size=world)))


def sc_two_passes(rank, world):
    rows = [_row(p, p) for p in range(61)]
    passes = rows + [_row(61 + p, p) for p in range(61)]
    return _record(_loader(Interleaved(passes, rank, world)))


def sc_rotated(rank, world):
    return _record(_loader(Rotated([_row(p, p) for p in range(120)], rank, 1)))


def sc_slow_split(rank, world):
    rows = [_row(p, p) for p in range(24)][rank::world]
    return _record(_loader(Slow(rows, 0.15), worker_timeout=timedelta(seconds=1)))


def sc_stuck_read(rank, world):
    rows = [_row(p, p) for p in range(24)]
    return _record(_loader(Slow(rows, 0.0, stuck=3), worker_timeout=timedelta(seconds=1)))


def sc_many(rank, world, calls):
    return {name: globals()[fn](rank, world) for name, fn in calls}
