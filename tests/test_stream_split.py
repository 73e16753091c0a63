"""The sharding checks on data that is split in ways they once got wrong (real gloo ranks, one world of 2).

- A stream whose pages repeat in a row, split interleaved (sample i to rank i mod W, as
  ``datasets.distributed.split_dataset_by_node`` does when the shards do not divide by W), puts each page's two
  copies on two ranks: it trains, every sample once (NOTE [ Neighbours dealt apart ]). A stream repeated for two
  passes and then split, and unsplit streams rotated by a sample, stay refused.
- A map-style dataset split per rank whose reads are slow is refused, not skipped: the check bounds each read
  by ``worker_timeout``, not their sum; a read past it refuses the epoch naming ``shard_check=False``.
The rates over many seeds: benchmarks/loader/shard_check_sim.py (docs/mistakes.md).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import split_scenarios as sc
from _dist import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

WORLD = 2
HAS_DATASETS = importlib.util.find_spec("datasets") is not None
CALLS = [("neighbours", "sc_neighbours"), ("two_passes", "sc_two_passes"), ("rotated", "sc_rotated"),
         ("slow_split", "sc_slow_split"), ("stuck_read", "sc_stuck_read")]
CALLS += [("neighbours_hf", "sc_neighbours_hf")] if HAS_DATASETS else []


@pytest.fixture(scope="module")
def world():
    per_rank = run_world(sc.sc_many, WORLD, CALLS, timeout=500)
    return {name: [r[name] for r in per_rank] for name, _ in CALLS}


def _refused_everywhere(res, *phrases):
    for r, out in enumerate(res):
        assert out["type"] in ("ValueError", "PeerError"), (r, out["type"], out["text"])
        assert not out["pos"], (r, len(out["pos"]))
        for phrase in phrases:
            assert phrase in out["text"], (r, phrase, out["text"])


@pytest.mark.parametrize("name", ["neighbours", pytest.param("neighbours_hf", marks=pytest.mark.skipif(
    not HAS_DATASETS, reason="needs datasets"))])
def test_a_stream_with_adjacent_repeats_split_interleaved_trains_every_sample_once(world, name):
    res = world[name]
    for out in res:
        assert out["type"] is None, out["text"]
    pos = sorted(p for out in res for p in out["pos"])
    assert pos == list(range(len(sc.crawl(240, seed=0 if name == "neighbours" else 1)))), len(pos)


def test_a_stream_repeated_for_two_passes_then_split_is_refused_naming_the_ways_past(world):
    _refused_everywhere(world["two_passes"], "streams overlap", "set_epoch", "shard_check=False")


def test_unsplit_streams_rotated_by_one_sample_are_refused(world):
    _refused_everywhere(world["rotated"], "streams overlap")


def test_a_split_dataset_with_slow_reads_is_refused_not_skipped(world):
    _refused_everywhere(world["slow_split"], "pass the whole dataset")


def test_a_read_past_worker_timeout_refuses_naming_the_item_and_the_flag(world):
    _refused_everywhere(world["stuck_read"], "could not read", "reading item 3 took longer than worker_timeout=1s",
                        "shard_check=False")


def test_items_without_token_ids_warn_naming_the_flag():
    from evenflow.runtime.shard_check import content_print

    warned = content_print([{"text": "a"}] * 20, 5.0).warning(1)
    assert warned is not None and "rank 1" in warned and "shard_check=False" in warned, warned
    assert content_print([{"input_ids": [i, 2]} for i in range(20)], 5.0).warning(1) is None


def test_neighbour_pairs_explain_an_interleaved_split_but_not_identical_streams():
    from evenflow.runtime.stream_check import neighbour_pairs, sketch, stream_verdict

    rng = np.random.default_rng(0)
    base = rng.integers(0, 2 ** 62, 3000)
    pages = np.repeat(base, 1 + (rng.random(len(base)) < 0.3))
    split = np.stack([sketch(pages[r::2][:1024].tolist(), 1024, 2) for r in range(2)])
    pairs, share, p = neighbour_pairs(split, 2)
    assert pairs > 100 and share < 0.75 and p > 0.001, (pairs, share, p)
    assert stream_verdict(split, 2) is None
    same = np.stack([sketch(base[:1024].tolist(), 1024, 2)] * 2)
    pairs, share, p = neighbour_pairs(same, 2)
    assert pairs == 1024 and share == 1.0 and p < 1e-100, (pairs, share, p)
    assert "streams overlap" in stream_verdict(same, 2)
