"""Hypothesis property tests of the protocol invariants at realistic sizes.

The model checker (test_model_checker.py) proves the invariants exhaustively on tiny worlds; here the same
invariants are checked on random larger ones: up to 8 ranks, 2,000 samples, lognormal long tails with a
coefficient of variation of 0.8-2.4 (chat data), uneven and empty ranks, every oversize policy, padded and
summed cost with sample/resource caps and padding, join and quota mode (over several epochs), and stops.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.planning import AlignmentConfig, GroupingConfig, run_epoch, wait_bound
from evenflow.planning.alignment import RankPlanner
from evenflow.planning.grouping import padded_length
from evenflow.planning.simulate import SampleMeta

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def quiet_drops(monkeypatch):
    """``oversize="drop"`` logs and warns per drop (tested in test_grouping.py); here it is only noise."""
    monkeypatch.setattr(logging.getLogger("evenflow"), "disabled", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


class Recorder(RankPlanner):
    """Records, per ``apply``: the ageing clock before it, whether the rank held anything, the slots."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, int, list]] = []

    def apply(self, decision, groups=None):
        rounds, held = self.rounds, len(self.buffer)
        slots = super().apply(decision, groups)
        self.log.append((rounds, held, slots))
        return slots


@dataclass
class World:
    grouping: GroupingConfig
    alignment: AlignmentConfig
    streams: list[list[SampleMeta]]
    sized: bool
    seed: int


def long_tail(rng: np.random.Generator, n: int, cv: float, median: float) -> np.ndarray:
    sigma = math.sqrt(math.log(1 + cv * cv))
    return np.maximum(1, np.rint(rng.lognormal(math.log(median), sigma, n))).astype(np.int64)


@st.composite
def worlds(draw, max_world=8, max_samples=2000, join=None):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    # The extremes are drawn often on purpose: the largest world, the most samples, the longest tail.
    world = draw(st.just(max_world) | st.integers(1, max_world))
    n = draw(st.just(max_samples) | st.integers(0, max_samples))
    cv = draw(st.sampled_from([0.8, 2.4]) | st.floats(0.8, 2.4))
    budget = draw(st.sampled_from([2048, 4096, 16384]))
    cost = draw(st.sampled_from(["padded", "summed"]))
    oversize = draw(st.sampled_from(["error", "alone", "drop"]))
    lengths = long_tail(rng, n, cv, median=draw(st.sampled_from([64, 256, 600])))
    pad = draw(st.sampled_from([None, 8, 64]))
    if oversize == "error":  # the caller's dataset truncates: nothing may exceed the budget
        lengths = np.minimum(lengths, (budget // (pad or 1)) * (pad or 1))
    patches = rng.integers(0, 3000, n) * (rng.random(n) < 0.3)  # 30 % of samples carry an image
    use_patches = draw(st.booleans())
    if use_patches and oversize == "error":
        patches = np.minimum(patches, 4096)
    grouping = GroupingConfig(token_budget=budget, cost=cost, oversize=oversize, pad_to_multiple_of=pad,
                              max_samples=draw(st.sampled_from([None, 4, 64])),
                              extra_budgets={"patches": 4096} if use_patches else {})
    alignment = AlignmentConfig(join=draw(st.booleans()) if join is None else join,
                                buffer_size=draw(st.sampled_from([1, 8, 64, 512])),
                                max_steps_per_round=draw(st.integers(1, 8)),
                                max_wait_rounds=draw(st.integers(1, 16)),
                                warmup_budgets=draw(st.sampled_from([None, 1, 4, 32])))
    # Uneven per-rank counts, some ranks possibly empty: cut the sample list at random points.
    cuts = np.sort(rng.integers(0, n + 1, world - 1))
    bounds = [0, *cuts.tolist(), n]
    streams = [[SampleMeta(key=i, length=int(lengths[i]), loss_tokens=int(lengths[i]) - 1,
                           extra=(("patches", int(patches[i])),) if use_patches else ())
                for i in range(bounds[r], bounds[r + 1])] for r in range(world)]
    return World(grouping, alignment, streams, sized=draw(st.booleans()), seed=seed)


def over_budget(meta: SampleMeta, g: GroupingConfig) -> bool:
    own = int(padded_length(np.array([meta.length]), g.pad_to_multiple_of)[0])
    return own > g.token_budget or any(v > g.extra_budgets.get(k, v) for k, v in meta.extra)


def group_ok(items, g: GroupingConfig) -> bool:
    lengths = np.array([it.length for it in items], dtype=np.int64)
    if g.cost == "padded":
        cost = len(lengths) * int(padded_length(lengths, g.pad_to_multiple_of).max())
    else:
        cost = int(padded_length(np.array([lengths.sum()]), g.pad_to_multiple_of)[0])
    within = cost <= g.token_budget and (g.max_samples is None or len(items) <= g.max_samples)
    within &= all(sum(it.extra.get(k, 0) for it in items) <= cap for k, cap in g.extra_budgets.items())
    meta = SampleMeta(None, items[0].length, extra=tuple(items[0].extra.items()))
    return within or (len(items) == 1 and g.oversize == "alone" and over_budget(meta, g))


def run_checked(w: World, planners, streams, *, stop_at_round=None):
    """One epoch through run_epoch, with every per-round invariant checked. Returns (trace, iterators)."""
    world, a, g = len(planners), w.alignment, w.grouping
    iters = [iter(s) for s in streams]
    held = [len(p.buffer) + len(s) for p, s in zip(planners, streams)]
    bound = (max(held) if a.join else min(held)) + 1  # NOTE [ Termination ]
    starts = [len(p.log) for p in planners]
    trace = run_epoch(planners, iters, unread=[len(s) for s in streams] if w.sized else None, max_rounds=bound,
                      stop_at_round=stop_at_round)
    assert len(trace.rounds) <= bound
    assert all(ex == trace.exchanges[0] for ex in trace.exchanges)  # same exchanges on every rank
    assert trace.exchanges[0] == ["report", "counts"] * len(trace.rounds)
    targets = [d.target for _, d in trace.rounds]
    assert len(trace.steps) == sum(targets)
    for p, start in zip(planners, starts):
        log = p.log[start:]
        assert [len(slots) for _, _, slots in log] == targets  # every rank emits the same number of steps
        for rounds, held_before, slots in log:
            for slot in slots:
                if not slot:
                    assert a.join and held_before == 0  # IDLE only on a rank with nothing left, in join mode
                    continue
                assert group_ok(slot, g), [it.length for it in slot]
                for it in slot:
                    assert rounds - it.arrived <= wait_bound(a)  # NOTE [ Bounded waiting ]
    steps_left = len(trace.steps)
    for _, d in trace.rounds:  # the announced bound never undershoots
        if d.steps_bound >= 0:
            assert d.steps_bound >= steps_left
        steps_left -= d.target
    return trace, iters


@SETTINGS
@given(worlds(join=True))
def test_join_mode_emits_every_sample_exactly_once(w):
    planners = [Recorder(w.grouping, w.alignment, seed=w.seed) for _ in w.streams]
    trace, _ = run_checked(w, planners, w.streams)
    assert not trace.stopped and trace.rounds[-1][1].epoch_done
    everything = [m.key for s in w.streams for m in s]
    dropped = [k for p in planners for k in p.dropped]
    expected_drops = [m.key for s in w.streams for m in s if over_budget(m, w.grouping)]
    assert sorted(dropped) == (sorted(expected_drops) if w.grouping.oversize == "drop" else [])
    keys = trace.keys()
    assert len(keys) == len(set(keys))
    assert sorted(keys + dropped) == sorted(everything)
    for r, stream in enumerate(w.streams):  # samples stay on the rank that read them
        assert set(trace.keys(r)) <= {m.key for m in stream}
    assert all(not p.buffer for p in planners)


@SETTINGS
@given(worlds(join=False), st.integers(2, 3))
def test_quota_mode_loses_nothing_across_epochs(w, epochs):
    """Each epoch closes when the first rank runs dry; leftovers stay buffered and leave in later epochs."""
    planners = [Recorder(w.grouping, w.alignment, seed=w.seed) for _ in w.streams]
    seen: list = []
    unread_total: list = []
    fed: list = []
    for epoch in range(epochs):
        # Every epoch re-reads the same per-rank data under new keys (a new pass over the dataset).
        streams = [[SampleMeta((epoch, m.key), m.length, m.loss_tokens, m.extra) for m in s] for s in w.streams]
        fed += [m.key for s in streams for m in s]
        trace, iters = run_checked(w, planners, streams)
        assert trace.rounds[-1][1].epoch_done
        unread = [[m.key for m in it] for it in iters]
        assert any(not p.buffer and not u for p, u in zip(planners, unread))  # the first dry rank closed it
        seen += trace.keys()
        unread_total += [k for u in unread for k in u]
    assert len(seen) == len(set(seen))
    carried = [it.key for p in planners for it in p.buffer]
    dropped = [k for p in planners for k in p.dropped]
    assert sorted(seen + carried + unread_total + dropped) == sorted(fed)  # nothing lost
    assert len(carried) <= len(planners) * w.alignment.buffer_size


@SETTINGS
@given(worlds(max_samples=600), st.integers(0, 6))
def test_stop_ends_every_rank_and_loses_nothing(w, stop_round):
    planners = [Recorder(w.grouping, w.alignment, seed=w.seed) for _ in w.streams]
    trace, iters = run_checked(w, planners, w.streams, stop_at_round=stop_round)
    if trace.stopped:
        assert len(trace.rounds) == stop_round + 1 and trace.rounds[-1][1].target == 0
    everything = sorted(m.key for s in w.streams for m in s)
    left = [it.key for p in planners for it in p.buffer] + [m.key for it in iters for m in it]
    dropped = [k for p in planners for k in p.dropped]
    assert sorted(trace.keys() + left + dropped) == everything


@SETTINGS
@given(worlds(max_world=4, max_samples=800))
def test_batches_are_a_function_of_seed_config_and_data(w):
    def once():
        planners = [RankPlanner(w.grouping, w.alignment, seed=w.seed) for _ in w.streams]
        trace = run_epoch(planners, [iter(s) for s in w.streams], unread=[len(s) for s in w.streams])
        return [[[it.key for it in slot] for slot in step] for step in trace.steps]

    first = once()
    assert once() == first
    sized = [[[it.key for it in slot] for slot in step] for step in run_epoch(
        [RankPlanner(w.grouping, w.alignment, seed=w.seed) for _ in w.streams],
        [iter(s) for s in w.streams]).steps]
    assert sized == first  # knowing the stream length changes the announced bound, never the batches


def _pile_up_run(seed, max_wait, buffer_size):
    """Rank 0: half short samples (8-63 tokens), half long ones (2048-4095) in random order; rank 1 forces
    T = 1. Fullest-first selection prefers a long singleton to any group of shorts, so without ageing the
    shorts wait until the longs run out."""
    rng = np.random.default_rng(seed)
    grouping = GroupingConfig(token_budget=4096)
    alignment = AlignmentConfig(buffer_size=buffer_size, max_steps_per_round=1, max_wait_rounds=max_wait)
    mixed = [SampleMeta(("s", i), int(rng.integers(8, 64))) for i in range(200)]
    mixed += [SampleMeta(("l", i), int(rng.integers(2048, 4096))) for i in range(200)]
    stream0 = [mixed[i] for i in rng.permutation(len(mixed))]
    stream1 = [SampleMeta(("x", i), 4096) for i in range(400)]  # one group per sample
    w = World(grouping, alignment, [stream0, stream1], sized=True, seed=seed)
    planners = [Recorder(grouping, alignment, seed=seed) for _ in w.streams]
    trace, _ = run_checked(w, planners, w.streams)
    assert sorted(trace.keys(0)) == sorted(m.key for m in stream0)
    return max(rounds - it.arrived for rounds, _, slots in planners[0].log for s in slots for it in s)


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4), st.sampled_from([16, 64]))
def test_long_samples_do_not_pile_up(seed, max_wait, buffer_size):
    alignment = AlignmentConfig(buffer_size=buffer_size, max_wait_rounds=max_wait)
    assert _pile_up_run(seed, max_wait, buffer_size) <= wait_bound(alignment)


def test_without_ageing_short_samples_would_pile_up():
    # The same run with ageing effectively off: waits far beyond the bound that ageing guarantees.
    aged = AlignmentConfig(buffer_size=64, max_wait_rounds=4)
    assert _pile_up_run(0, 4, 64) <= wait_bound(aged) < 2 * wait_bound(aged) < _pile_up_run(0, 10_000, 64)
