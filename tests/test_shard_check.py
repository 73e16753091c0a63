"""Sharding mistakes are refused on every rank in the first round (NOTE [ Sharding mistakes ] in
evenflow.runtime.shard_check): a map-style dataset already split per rank with datasets' split_dataset_by_node
(equal lengths on every rank, so len() cannot tell), and an IterableDataset every rank reads identically. The
right setups train; a ``__getitem__`` with random lengths is refused naming ``shard_check=False``, which trains
it. Real gloo ranks (the rest of issue 34's cases: tests/test_mistakes.py)."""

from __future__ import annotations

import importlib.util
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import evenflow
from _dist import RankFailed, run_world

pytestmark = pytest.mark.multiprocess
needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs datasets")

N = 120


def _rows(n: int = N) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"input_ids": [i] * int(rng.integers(4, 60))} for i in range(n)]


def _train(loader) -> list[int]:
    seen = []
    try:
        for batch in loader:
            seen.extend(evenflow.pop_step_info(batch).sample_ids)
    finally:
        loader.close()
    return seen


def _hf_split(rank, world, split):
    from datasets import Dataset as HFDataset
    from datasets.distributed import split_dataset_by_node

    ds = HFDataset.from_list(_rows()).with_format("torch")
    if split:
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
    loader = evenflow.DynamicBatchLoader(ds, token_budget=256, timeout=timedelta(seconds=60))
    return _train(loader)


@needs_datasets
def test_a_dataset_split_by_node_is_refused_on_every_rank():
    """At fbdadc2 each rank trained its shard of its shard: 1/W of the data, silently."""
    results = run_world(_hf_split, 3, True, timeout=180, allow_errors=True)
    assert all(isinstance(r, RankFailed) for r in results), results
    for r in results:
        assert "ValueError" in r.text and "split_dataset_by_node" in r.text and "pass the whole dataset" in r.text


@needs_datasets
def test_the_whole_dataset_on_every_rank_trains_each_sample_once():
    results = run_world(_hf_split, 2, False, timeout=180)
    assert sorted(i for r in results for i in r) == list(range(N))


class _RandomLengths(Dataset):
    """Random lengths on every read (a random crop): its content cannot be compared across ranks."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return {"input_ids": torch.full((int(torch.randint(4, 50, ())),), i)}


def _random(rank, world):
    try:
        refused = _train(evenflow.DynamicBatchLoader(_RandomLengths(), token_budget=256, timeout=timedelta(seconds=60)))
    except ValueError as exc:
        refused = str(exc)
    loader = evenflow.DynamicBatchLoader(_RandomLengths(), token_budget=256, timeout=timedelta(seconds=60),
                                         shard_check=False)
    return refused, _train(loader)


def test_a_random_getitem_is_refused_as_such_naming_the_flag_that_trains_it():
    """Issue 34: token ids that change between reads cannot be compared (a split dataset with random crops would
    pass), so they are refused -- as what they are, not as a split -- naming shard_check=False (before issue 34
    they were accepted, and so was a split dataset with random crops)."""
    results = run_world(_random, 2, timeout=180)
    for refused, _ in results:
        assert isinstance(refused, str) and "change between reads" in refused and "shard_check=False" in refused
    assert sorted(i for _, r in results for i in r) == list(range(40))


class _Same(IterableDataset):
    """The same stream on every rank (not split): every sample would train W times."""

    def __iter__(self):
        for row in _rows(40):
            yield {"input_ids": torch.tensor(row["input_ids"])}


class _Split(_Same):
    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __iter__(self):
        for k, sample in enumerate(super().__iter__()):
            if k % self.world == self.rank:
                yield sample


def _iterable(rank, world, split):
    ds = _Split(rank, world) if split else _Same()
    return _train(evenflow.DynamicBatchLoader(ds, token_budget=256, buffer_size=16, timeout=timedelta(seconds=60)))


def test_identical_iterable_streams_are_refused_on_every_rank():
    """At fbdadc2 every sample trained W times (documented, not detected)."""
    results = run_world(_iterable, 2, False, timeout=180, allow_errors=True)
    assert all(isinstance(r, RankFailed) for r in results), results
    for r in results:
        assert "ValueError" in r.text and "streams overlap" in r.text and "split_dataset_by_node" in r.text


def test_split_iterable_streams_train():
    results = run_world(_iterable, 2, True, timeout=180)
    assert len(results[0]) + len(results[1]) == 40
