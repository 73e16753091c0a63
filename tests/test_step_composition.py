"""Issue 18: what the default plans train -- the composition metrics, and the stratified mix that meets them.

The metrics (:mod:`evenflow.sim.composition`) are checked on schedules whose answer is known (random batches,
a curriculum), the pure pieces of the mix (:mod:`evenflow.planning.pooled.mix`) on small cases, and the default
against the pre-issue-18 planner (``mix="cost_order"``) on seeded chat-like epochs: steps mixed and unordered,
batching as tight.
"""

from __future__ import annotations

import numpy as np
import pytest

from evenflow.planning import AlignmentConfig, GroupingConfig
from evenflow.planning.pooled.mix import EpochProgress, band_steps, round_order, select_steps, systematic
from evenflow.sim import Schedule, global_schedule
from evenflow.sim.composition import step_composition


def _chat_lengths(n: int, seed: int, cutoff: int = 8192) -> np.ndarray:
    rng = np.random.default_rng(seed)  # long-tailed like chat: median ~250, CV ~1.2, cut at 8,192
    return np.clip(rng.lognormal(5.6, 1.0, n).astype(np.int64) + 8, 8, cutoff)


# -- the metrics -------------------------------------------------------------------------------------------

def test_random_batches_score_one_and_a_curriculum_scores_high():
    ls = _chat_lengths(4000, 0)
    rng = np.random.default_rng(1)
    order = rng.permutation(ls.size)
    random_steps = [[order[i:i + 10].tolist()] for i in range(0, ls.size, 10)]  # one micro-batch of 10 per step
    c = step_composition(Schedule.from_steps(random_steps, 1), ls)
    assert 0.8 < c["H"] < 1.25 and abs(c["late"] - 0.25) < 0.05 and c["q_cv"] < 0.05 and 0.8 < c["rough"] < 1.25
    assert c["timing"] < 0.05
    by_len = np.argsort(ls, kind="stable")  # shortest first: a curriculum of homogeneous steps
    curriculum = [[by_len[i:i + 10].tolist()] for i in range(0, ls.size, 10)]
    c = step_composition(Schedule.from_steps(curriculum, 1), ls)
    assert c["H"] > 3 and c["late"] == 1.0 and c["q_cv"] > 0.5 and c["rough"] < 0.05  # a smooth ramp
    assert c["timing"] > 0.4  # the shortest tenth trains in the first tenth of the epoch


def test_timing_sees_a_short_tail_held_back():
    """Random steps, except that the shortest tenth is packed into the last few steps (what a planner that lets
    tiny samples wait does): late and H do not see it, timing does. (q_cv does here, 0.13; the default's
    steering hid it from q_cv by sending the next-shortest tenths early instead -- timing sees both.)"""
    ls = _chat_lengths(4000, 0)
    order = np.random.default_rng(3).permutation(ls.size)
    short = np.argsort(ls, kind="stable")[:400]
    rest = order[~np.isin(order, short)]
    steps = [[rest[i:i + 10].tolist()] for i in range(0, rest.size, 10)] + [[short[i:i + 100].tolist()]
                                                                                for i in range(0, 400, 100)]
    c = step_composition(Schedule.from_steps(steps, 1), ls)
    assert abs(c["late"] - 0.25) < 0.05 and c["H"] < 1.25
    assert c["timing"] > 0.45


def test_rough_sees_the_order_of_the_same_steps():
    ls = _chat_lengths(4000, 0)
    by_len = np.argsort(ls, kind="stable")
    steps = [[by_len[i:i + 10].tolist()] for i in range(0, ls.size, 10)]  # homogeneous steps, shortest first
    shuffled = [steps[i] for i in np.random.default_rng(2).permutation(len(steps))]
    alternating = [steps[i // 2] if i % 2 == 0 else steps[-1 - i // 2] for i in range(len(steps))]
    c = {name: step_composition(Schedule.from_steps(s, 1), ls)
         for name, s in (("sorted", steps), ("shuffled", shuffled), ("alternating", alternating))}
    hs = [v["H"] for v in c.values()]
    assert max(hs) < 1.05 * min(hs)  # H does not see the order (its random denominators differ a little)
    assert c["sorted"]["rough"] < 0.05
    assert 0.8 * c["shuffled"]["H"] < c["shuffled"]["rough"] < 1.25 * c["shuffled"]["H"]  # random order: ~H
    assert c["alternating"]["rough"] > 1.5 * c["shuffled"]["H"]  # short-long-short: up to ~2H


def test_h_g_compares_with_the_same_micro_batches_dealt_at_random():
    ls = np.array([10, 10, 1000, 1000] * 8)
    short, long_ = np.flatnonzero(ls == 10), np.flatnonzero(ls == 1000)
    mixed = [[[int(a)], [int(b)]] for a, b in zip(short, long_)]  # every step: one short, one long
    homogeneous = [[[int(a)], [int(b)]] for a, b in zip(short[::2], short[1::2])] + \
                  [[[int(a)], [int(b)]] for a, b in zip(long_[::2], long_[1::2])]
    assert step_composition(Schedule.from_steps(mixed, 2), ls)["H_g"] < 1e-9
    # (m_s is token-weighted, so a random short+long step counts mostly as long: the ratio is ~1.4, not 3)
    assert step_composition(Schedule.from_steps(homogeneous, 2), ls)["H_g"] > 1.2
    # accumulation: two homogeneous loader steps (short, long) in one optimizer step are a mixed step
    paired = [s for pair in zip(homogeneous[:8], homogeneous[8:]) for s in pair]
    assert step_composition(Schedule.from_steps(paired, 2), ls, grad_accum_steps=2)["H_g"] < 1e-9


# -- the pure pieces ---------------------------------------------------------------------------------------

def test_band_steps_mix_lengths_within_cost_bands_only():
    rng = np.random.default_rng(0)
    world = 4
    times = np.concatenate([rng.uniform(990, 1000, 40), rng.uniform(500, 505, 8)])
    keys = rng.uniform(0, 10, times.size)
    steps = band_steps(times, keys, world, 0.02)
    assert sorted(steps.ravel().tolist()) == list(range(times.size))  # every group exactly once
    spread = times[steps].max(axis=1) / times[steps].min(axis=1)
    assert spread.max() <= 1.02 + 1e-12  # balance: a step never mixes the two cost levels
    top = steps[np.isin(steps, np.arange(40)).all(axis=1)]
    assert len(top) == 10
    # each step takes one group from every quarter of the band's keys (the strata)
    quarter = np.searchsorted(np.sort(keys[:40]), keys[top], side="right") - 1
    assert (np.sort(quarter // 10, axis=1) == np.arange(4)).all()


def test_select_steps_is_a_systematic_sample_and_lets_the_oldest_go():
    c, steps = 40, 4
    stats = np.stack((np.arange(1, c + 1), np.full(c, 1000)), axis=1)  # mean lengths 1000 / (1..40)
    buffered = (int(stats[:, 0].sum()), int(stats[:, 1].sum()))
    for r in range(30):
        pick = select_steps(stats, np.zeros(c, int), steps, progress=EpochProgress(round=r, samples=0, tokens=0),
                            buffered=buffered, max_wait=16)
        assert len(set(pick.tolist())) == steps
        chunks = np.sort((c - 1 - pick) // (c // steps))  # candidates sorted by mean length: count descending
        assert chunks.tolist() == list(range(steps))  # one pick per length stratum, steered or not
    # the offsets alone: over rounds every position of a chunk is taken
    assert set(np.concatenate([systematic(c, steps, r) for r in range(30)]).tolist()) == set(range(c))
    ages = np.zeros(c, int)
    ages[7] = 20  # waited past max_wait: it goes, whatever the offset
    for r in range(10):
        assert 7 in select_steps(stats, ages, steps, progress=EpochProgress(round=r), buffered=buffered, max_wait=16)


def test_select_steps_never_picks_a_candidate_twice():
    # Steering swaps within a chunk: the systematic pick of chunk j must lie in chunk j, for any sizes and
    # offsets, or a swap could take a neighbour's pick (a duplicate pick leaves a step IDLE).
    rng = np.random.default_rng(2)
    for _ in range(400):
        c = int(rng.integers(2, 60))
        steps = int(rng.integers(1, c))
        stats = np.stack((rng.integers(1, 300, c), rng.integers(100, 16_384, c)), axis=1)
        ages = rng.integers(0, 20, c)
        progress = EpochProgress(round=int(rng.integers(0, 50)), samples=int(rng.integers(0, 5000)),
                                 tokens=int(rng.integers(0, 5_000_000)))
        pick = select_steps(stats, ages, steps, progress=progress,
                            buffered=(int(stats[:, 0].sum()), int(stats[:, 1].sum())), max_wait=16)
        assert len(set(pick.tolist())) == steps == len(pick)
        if ages.max() >= 16:
            assert ages[pick].max() == ages.max()  # the oldest goes


def test_round_order_zigzags_or_alternates_under_accumulation():
    keys = np.array([3.0, 9.0, 1.0, 7.0, 5.0, 8.0])
    assert keys[round_order(keys, 0)].tolist() == [1.0, 3.0, 5.0, 7.0, 8.0, 9.0]
    assert keys[round_order(keys, 1)].tolist() == [9.0, 8.0, 7.0, 5.0, 3.0, 1.0]  # meets round 0 at its end
    assert keys[round_order(keys, 7, grad_accum_steps=2)].tolist() == [1.0, 9.0, 3.0, 8.0, 5.0, 7.0]
    assert systematic(12, 3, 0).tolist() == [0, 4, 8]
    for r in range(20):  # one position per chunk, whatever the offset
        assert ((systematic(10, 4, r) - np.array([0, 2, 5, 7])) < np.array([2, 3, 2, 3])).all()


# -- the default on whole epochs ----------------------------------------------------------------------------

def _trend(schedule, ls: np.ndarray) -> float:
    """Spearman correlation of step position with the step's mean log-length: a curriculum's signature."""
    from scipy.stats import spearmanr

    means = [np.log(ls[[i for g in step for i in g]]).mean() for step in schedule.batches() if any(step)]
    return float(spearmanr(np.arange(len(means)), means)[0])


@pytest.mark.parametrize("world", [2, 4, 8])
def test_default_is_mixed_unordered_and_as_tight_as_before(world):
    ls = _chat_lengths(12_000, world)
    grouping = GroupingConfig(token_budget=16_384)
    runs = {mix: global_schedule(ls, world_size=world, grouping=grouping, mix=mix) for mix in ("stratified", "cost_order")}
    comp = {mix: step_composition(s, ls) for mix, s in runs.items()}
    new, old = comp["stratified"], comp["cost_order"]
    runs["stratified"].check_exactly_once(ls.size)
    # the epoch is no curriculum: the longest tenth trains evenly over the quarters, no trend in step length
    assert abs(new["late"] - 0.25) <= 0.04 and abs(_trend(runs["stratified"], ls)) <= 0.1, new
    assert old["late"] > 0.3 and _trend(runs["cost_order"], ls) > 0.5, old  # the control: before, it was one
    # Quarters look alike where a quarter holds many rounds. With one micro-batch per rank each round is a
    # length ramp (NOTE [ Round order ]), so on short epochs a quarter that cuts a ramp differs (here 88 and
    # 43 steps at W = 4 and 8: q_cv 0.08 and 0.13); with accumulation the rounds alternate and it holds everywhere.
    assert new["S"] < 160 or new["q_cv"] <= 0.06, new
    accum = step_composition(global_schedule(ls, world_size=world, grouping=grouping, grad_accum_steps=2), ls)
    assert accum["q_cv"] <= 0.06 and old["q_cv"] > 0.1, (accum, old)
    # steps are more mixed than before; at W = 2 about as mixed as the same micro-batches dealt at random
    # (NOTE [ Stratified steps ]: at W = 8 balance forbids it, and the gain is small)
    assert new["H_g"] < old["H_g"] and (world > 2 or new["H_g"] <= 1.05), (new, old)

    def batching(s):
        b = s.batches()
        pad = np.array([[len(g) * ls[g].max() if g else 0 for g in st] for st in b], dtype=float)
        return s.num_steps, ls.sum() / pad.sum(), float((pad.max(1) / pad.mean(1)).mean())

    (n1, e1, i1), (n0, e0, i0) = batching(runs["stratified"]), batching(runs["cost_order"])
    assert n1 <= max(n0 * 1.005, n0 + 1) and e1 >= e0 - 0.006 and i1 <= i0 + 0.01, ((n1, e1, i1), (n0, e0, i0))


def test_grad_accum_windows_pair_short_with_long():
    # NOTE [ Round order ]: with accumulation a round alternates short- and long-heavy steps, so a window mixes;
    # with one micro-batch per rank it runs as a zigzag, consecutive steps alike (the control: windows don't mix)
    ls = _chat_lengths(6000, 3)
    grouping = GroupingConfig(token_budget=16_384)
    accum = global_schedule(ls, world_size=2, grouping=grouping, grad_accum_steps=2)
    one, two = step_composition(accum, ls), step_composition(accum, ls, grad_accum_steps=2)
    assert two["H_g"] <= one["H_g"] + 0.05, (one, two)
    zigzag = global_schedule(ls, world_size=2, grouping=grouping)
    def contents(schedule):
        return sorted(tuple(sorted(i for g in step for i in g)) for step in schedule.batches())

    assert contents(zigzag) == contents(accum)  # the same steps, only their order differs
    assert step_composition(zigzag, ls, grad_accum_steps=2)["H_g"] > two["H_g"] + 0.2
    assert step_composition(zigzag, ls)["rough"] < 0.5 * one["rough"]  # one micro-batch: consecutive steps alike


def test_small_buffer_keeps_the_mix():
    ls = _chat_lengths(3000, 4, cutoff=4096)
    s = global_schedule(ls, world_size=2, grouping=GroupingConfig(token_budget=4096),
                        alignment=AlignmentConfig(buffer_size=128))
    c = step_composition(s, ls)
    s.check_exactly_once(ls.size)
    old = step_composition(global_schedule(ls, world_size=2, grouping=GroupingConfig(token_budget=4096),
                                           alignment=AlignmentConfig(buffer_size=128), mix="cost_order"), ls)
    assert c["H_g"] < old["H_g"] and abs(c["late"] - 0.25) <= 0.05, (c, old)


# -- states saved before issue 18 ---------------------------------------------------------------------------

def _resume_pre18(rank, world, path):
    import json

    import evenflow
    from loader_scenarios import BUDGET, TokenDataset

    saved = json.loads(open(path).read())
    loader = evenflow.DynamicBatchLoader(TokenDataset(saved["n"]), token_budget=BUDGET, buffer_size=32, seed=7)
    loader.load_state_dict(saved["ranks"][rank]["state"])
    loader.set_epoch(1)
    after = [i for batch in loader for i in evenflow.pop_step_info(batch).sample_ids]
    loader.close()
    return after


@pytest.mark.multiprocess
def test_a_state_saved_by_the_pre_issue_18_planner_resumes_exactly_once():
    # tests/data/pre18_states.json: 2 ranks of evenflow at fbdadc2 (cost-order global planning) stopped at step 4
    # of epoch 1; what they trained before is recorded. Today's planner finishes the epoch: nothing lost or twice.
    import json
    from pathlib import Path

    from _dist import run_world

    path = Path(__file__).with_name("data") / "pre18_states.json"
    saved = json.loads(path.read_text())
    after = run_world(_resume_pre18, saved["world"], str(path), timeout=120)
    trained = [i for r in saved["ranks"] for i in r["trained"]] + [i for r in after for i in r]
    assert sorted(trained) == list(range(saved["n"]))
