"""A resume onto the same samples in another order is refused; a refusal that depends on one rank's carry is made
on every rank; ``set_epoch(e, discard_resumed=True)`` drops the state for any epoch.

The real-process cases run in one gloo world of 2 ranks (tests/resume_scenarios.py); the fingerprint's own
bounds (reads, cost on a million samples, what it cannot compare) are checked in one process.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch

import evenflow
import resume_scenarios as sc
from _dist import run_world
from evenflow.runtime.resume_print import READS, STABLE_READS, read_positions, resume_print

WORLD = 2
CALLS = [("reordered", "sc_reordered_resume"), ("quota_carry", "sc_quota_carry_on_one_rank"),
         ("one_rank", "sc_refused_on_one_rank"), ("discard", "sc_discard_at_the_saved_epoch")]


@pytest.fixture(scope="module")
def world():
    per_rank = run_world(sc.sc_many, WORLD, CALLS, timeout=240)
    return {name: [r[name] for r in per_rank] for name, _ in CALLS}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("known", [False, True], ids=["no_lengths", "lengths"])
@pytest.mark.parametrize("name", ["files_swapped", "sorted_in_files", "equal_length_swap"])
def test_a_reordered_dataset_is_refused_at_load_on_every_rank(world, name, known):
    """Each reorder leaves indices 0, 20, ..., 140 in place: an 8-item fingerprint accepted all three, and the
    resumed epoch trained some samples twice and others never."""
    for r, out in enumerate(world["reordered"]):
        res = out[(name, known)]
        assert not res["accepted"], (r, name, "accepted", res.get("ids"))
        assert res["type"] == "ValueError" and "not in its order" in res["text"], res["text"][-2000:]
        assert f"rank {r}" in res["text"] and "sorted(os.listdir" in res["text"], res["text"][-2000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("known", [False, True], ids=["no_lengths", "lengths"])
def test_the_saved_order_resumes_every_sample_once(world, known):
    outs = [out[("same", known)] for out in world["reordered"]]
    assert all(o["type"] is None for o in outs), [o["text"][-2000:] for o in outs]
    trained = sorted([i for o in outs for i in o["before"]] + [i for o in outs for i in o["ids"]])
    assert trained == list(range(sc.FILES * sc.PER_FILE))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_set_epoch_that_drops_one_ranks_carry_is_refused_on_every_rank(world):
    """Rank 0 carries samples, rank 1 none: set_epoch(saved + 2) was refused on rank 0 only, and rank 1 trained
    into an exchange its peer never joined (a bare gloo error or the whole timeout)."""
    res = world["quota_carry"]
    assert res[0]["carries"] > 0 and res[1]["carries"] == 0, [r["carries"] for r in res]
    for r, out in enumerate(res):
        later = out["later"]
        assert later is not None and later["type"] == "ValueError", (r, out.get("trained", {}).get("text", "")[-2000:])
        assert "discard_resumed=True" in later["text"] and f"set_epoch({out['epoch'] + 1})" in later["text"]
    assert "a peer's state may carry some" in res[1]["later"]["text"], res[1]["later"]["text"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,refusing,phrase", [("order", 0, "not in its order"),
                                                   ("rank", 1, "state of rank 0 loaded on rank 1")])
def test_a_load_refused_on_one_rank_reaches_the_peer_that_resumed_as_peer_error(world, name, refusing, phrase):
    """The peer that resumed waited in its first exchange for the refusing rank, then failed on the timeout."""
    res = [out[name] for out in world["one_rank"]]
    assert res[refusing]["type"] == "ValueError" and phrase in res[refusing]["text"], res[refusing]["text"][-2000:]
    peer = res[1 - refusing]
    assert peer["type"] == "PeerError" and not peer["ids"], peer["text"][-2000:]
    assert f"rank {refusing}" in peer["text"] and phrase in peer["text"], peer["text"][-2000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_discard_resumed_at_the_saved_epoch_starts_it_afresh(world):
    """The way past a state that does not fit the stream, called up front: it kept the state, and the other
    stream was refused again in the first round."""
    res = world["discard"]
    for out in res:
        assert out["stream"]["type"] is None, out["stream"]["text"][-2000:]
        assert out["map"]["type"] is None, out["map"]["text"][-2000:]
    assert sorted(i for out in res for i in out["stream"]["ids"]) == list(range(96))
    assert sorted(i for out in res for i in out["map"]["ids"]) == list(range(120))  # the whole epoch, not its rest


# -- in one process --------------------------------------------------------------------------------------------
class _Lazy:
    """A million token samples, built on read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"input_ids": torch.arange(i % 97 + 2)}


def test_reads_are_bounded_and_spread_and_lengths_cost_milliseconds():
    n = 1_000_000
    picks = read_positions(n)
    assert len(picks) == READS and len(set(picks.tolist())) == READS
    ordered = np.sort(picks).tolist()
    assert all(k * n // READS <= p < (k + 1) * n // READS for k, p in enumerate(ordered))  # one per stratum
    assert np.abs(np.sort(picks[:32]) / n - (np.arange(32) + 0.5) / 32).max() < 0.25  # a prefix is spread too
    assert sorted(read_positions(100).tolist()) == list(range(100))
    lengths = np.random.default_rng(0).integers(1, 4096, n)
    started = time.perf_counter()
    made = resume_print(_Lazy(n), [lengths], limit_s=60)
    took = time.perf_counter() - started
    assert took < 2.0, took
    assert made.tokens is not None and made.lengths is not None and made.reads == READS
    swapped = lengths.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert resume_print(_Lazy(n), [swapped], limit_s=60).lengths != made.lengths or lengths[10] == lengths[11]


def test_with_lengths_slow_reads_stop_early_and_a_resume_reads_the_same_items(monkeypatch):
    import evenflow.runtime.resume_print as rp

    monkeypatch.setattr(rp, "LENGTHS_READ_S", 0.3)  # the test's time, not the rule's
    monkeypatch.setattr(rp, "READ_S", 0.2)
    class Slow(torch.utils.data.Dataset):
        def __init__(self, order):
            self.order = order

        def __len__(self):
            return len(self.order)

        def __getitem__(self, i):
            time.sleep(0.01)
            return {"input_ids": torch.tensor([int(self.order[i]), 1, 2])}

    order = np.arange(2000)
    lengths = [np.full(2000, 3)]  # equal lengths: only the reads can tell a reorder
    started = time.perf_counter()
    saved = resume_print(Slow(order), lengths, limit_s=60)
    assert time.perf_counter() - started < rp.LENGTHS_READ_S + 1.0 and STABLE_READS <= saved.reads < READS
    same = resume_print(Slow(order), lengths, limit_s=60, reads=saved.reads)
    assert same.tokens == saved.tokens and same.reads == saved.reads
    moved = order.copy()
    first = int(read_positions(2000)[0])
    moved[[first, first ^ 1]] = moved[[first ^ 1, first]]  # a read item swapped with its neighbour
    assert resume_print(Slow(moved), lengths, limit_s=60, reads=saved.reads).tokens != saved.tokens
    unknown = resume_print(Slow(order), None, limit_s=60)  # without lengths: at least MIN_READS items
    assert rp.MIN_READS <= unknown.reads < READS and unknown.tokens is not None and unknown.lengths is None


def test_a_fingerprint_that_could_not_be_taken_warns_naming_why():
    class Crops(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return {"input_ids": torch.randint(1, 9, (5,))}

    assert "change between reads" in resume_print(Crops(), None, limit_s=30).why
    loader = evenflow.DynamicBatchLoader(Crops(), token_budget=16, buffer_size=8)
    batches = iter(loader)
    evenflow.pop_step_info(next(batches))
    state = loader.state_dict()
    loader.close()
    assert state["data"]["tokens"] is None and state["version"] == evenflow.runtime.loader.STATE_VERSION
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evenflow.DynamicBatchLoader(Crops(), token_budget=16, buffer_size=8).load_state_dict(state)
    text = " ".join(str(w.message) for w in caught)
    assert "without comparing the dataset's token content" in text and "Pass lengths=" in text, text
    assert STABLE_READS <= READS
