"""Planners: golden tables, oracles (MILP, brute force) and hypothesis properties. Pure, one process."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.balance import (BalanceConfig, Topology, balance, karmarkar_karp, loads, lower_bound, lpt, lpt_batched,
                              makespan, milp_balance, padded_loads, padded_partition, plan_balance, refine_swaps,
                              transfer_bytes)
from evenflow.balance.planners import refine_pairs

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

small_costs = st.lists(st.integers(min_value=0, max_value=50), min_size=0, max_size=8)
any_costs = st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=0, max_size=60)


# -- golden tables -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("costs, ranks, want_max", [
    ([5, 4, 3, 3, 3], 2, 9.0),        # LPT alone gives 10; a swap reaches the optimum
    ([7, 7, 6, 6, 5, 5, 4, 4, 4], 3, 16.0),
    ([10], 4, 10.0),                  # fewer items than ranks
    ([], 3, 0.0),
    ([1, 1, 1, 1], 4, 1.0),
])
def test_lpt_golden(costs, ranks, want_max):
    assert makespan(costs, lpt(costs, ranks), ranks) == want_max


def test_lpt_batched_golden_note_example():
    # NOTE [ Batched LPT ]: 4 ranks, chunks of 2.
    out = lpt_batched([9, 5, 4, 4, 3, 3, 2, 2], 4, chunk=2, refine=False)
    assert loads([9, 5, 4, 4, 3, 3, 2, 2], out, 4).tolist() == [9, 7, 9, 7]


def test_padded_partition_note_example():
    # NOTE [ Padded balancing is contiguous ]: lengths [8, 5, 4, 4, 3] on 2 ranks -> T* = 16.
    u = [8, 5, 4, 4, 3]
    assert padded_loads(u, padded_partition(u, 2, fill_ranks=False), 2).max() == 16


def test_plan_balance_doc_example_and_determinism():
    args = ([4, 4, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1], 2)
    assert plan_balance(*args) == [0, 1, 0, 0, 1, 1]
    assert all(plan_balance(*args) == plan_balance(*args) for _ in range(3))


# -- errors name the item and the fix --------------------------------------------------------------------------

@pytest.mark.parametrize("costs, sources, match", [
    ([1.0, 2.0, float("nan")], [0, 0, 0], r"item 2: cost nan is not finite"),
    ([1.0, -2.0], [0, 0], r"item 1: cost -2.0 is negative"),
    ([1.0, 2.0, 3.0], [0, 5, 0], r"item 1: source rank 5 is outside \[0, 2\)"),
    ([1.0, 2.0], [0], r"one source rank per item"),
    ([1.0, 2.0], [0, 0.5], r"item 1: source 0.5 is not an integer rank"),
])
def test_bad_input_names_item(costs, sources, match):
    with pytest.raises(ValueError, match=match):
        plan_balance(costs, sources, 2)


def test_cap_errors_name_item_and_knob():
    with pytest.raises(ValueError, match=r"item 1: weight 9 exceeds cap=5 on its own.*raise cap"):
        plan_balance([1, 9], [0, 0], 2, cap=5)
    with pytest.raises(ValueError, match=r"no rank has room.*raise cap, add ranks, or use method='milp'"):
        lpt([3, 3, 3], 2, cap=4)
    with pytest.raises(ValueError, match=r"no assignment"):
        milp_balance([3, 3, 3], 2, cap=4)
    with pytest.raises(ValueError, match="num_ranks"):
        plan_balance([1], [0], 0)


# -- oracles -------------------------------------------------------------------------------------------------

@FAST
@given(small_costs, st.integers(1, 3))
def test_lpt_within_four_thirds_of_milp_optimum(costs, ranks):
    opt = makespan(costs, milp_balance(costs, ranks), ranks)
    lb = lower_bound(costs, ranks)
    assert opt >= lb - 1e-9
    for plan in (lpt(costs, ranks, refine=False), lpt(costs, ranks)):
        assert makespan(costs, plan, ranks) <= (4 / 3) * opt + 1e-9
    assert makespan(costs, lpt(costs, ranks), ranks) <= makespan(costs, lpt(costs, ranks, refine=False), ranks)


def _brute_padded(u: list[int], ranks: int) -> float:
    best = float("inf")
    for assign in itertools.product(range(ranks), repeat=len(u)):
        best = min(best, float(padded_loads(u, assign, ranks).max(initial=0)))
    return best


@FAST
@given(st.lists(st.integers(1, 20), min_size=1, max_size=7), st.integers(1, 3))
def test_padded_partition_is_exact(u, ranks):
    out = padded_partition(u, ranks)
    assert padded_loads(u, out, ranks).max() == _brute_padded(u, ranks)
    assert int((np.bincount(out, minlength=ranks) > 0).sum()) == min(len(u), ranks)  # fill_ranks


@FAST
@given(st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=40), st.integers(1, 6))
def test_padded_partition_float_costs_never_worse_than_any_contiguous_greedy(u, ranks):
    out = padded_partition(u, ranks)
    assert set(out.tolist()) <= set(range(ranks))
    # Every item placed once; cost at most the trivial one-bucket cost and at least the lower bounds.
    top = padded_loads(u, out, ranks).max()
    assert top <= len(u) * max(u) * (1 + 1e-12)
    assert top >= max(u) * (1 - 1e-12)


# -- properties ------------------------------------------------------------------------------------------------

@FAST
@given(any_costs, st.integers(1, 9), st.sampled_from(["lpt", "lpt_batched", "kk", "milp"]))
def test_every_method_conserves_items(costs, ranks, method):
    if method == "milp" and len(costs) * ranks > 60:
        costs = costs[: max(1, 60 // ranks)]
    out = balance(costs, ranks, config=BalanceConfig(method=method))
    assert out.shape == (len(costs),)
    assert ((0 <= out) & (out < ranks)).all()
    assert makespan(costs, out, ranks) >= lower_bound(costs, ranks) - 1e-6 * max(1.0, lower_bound(costs, ranks))


@FAST
@given(any_costs, st.integers(1, 9), st.floats(0.1, 3.0))
def test_caps_are_respected_or_refused(costs, ranks, slack):
    cap = max(max(costs, default=1.0), sum(costs) / ranks) * slack
    if cap <= 0:
        return
    try:
        out = plan_balance(costs, [0] * len(costs), ranks, cap=cap)
    except ValueError as exc:
        assert "cap" in str(exc)
        return
    assert loads(costs, out, ranks).max(initial=0) <= cap * (1 + 1e-12)


@FAST
@given(st.lists(st.integers(0, 100), max_size=40), st.lists(st.integers(1, 30), min_size=40, max_size=40),
       st.integers(1, 6), st.floats(0.5, 2.0))
def test_cap_on_separate_weights(costs, weights, ranks, slack):
    weights = weights[:len(costs)]
    cap = max(max(weights, default=1), sum(weights) / ranks) * slack
    try:
        out = lpt(costs, ranks, cap=cap, cap_weights=weights)
    except ValueError as exc:
        assert "cap" in str(exc)
        return
    assert loads(weights, out, ranks).max(initial=0) <= cap + 1e-9


@FAST
@given(any_costs, st.integers(1, 9), st.sampled_from(["lpt", "lpt_batched", "milp"]))
def test_equal_counts(costs, ranks, method):
    if method == "milp":
        costs = costs[: max(1, 40 // ranks)]
    out = balance(costs, ranks, config=BalanceConfig(method=method, equal_counts=True))
    counts = np.bincount(out, minlength=ranks)
    assert counts.max() - counts.min() <= 1


@FAST
@given(any_costs, st.integers(1, 9))
def test_refinement_never_raises_the_max(costs, ranks):
    rng = np.random.default_rng(len(costs))
    start = rng.integers(0, ranks, len(costs))
    before = makespan(costs, start, ranks)
    assert makespan(costs, refine_swaps(costs, start, ranks), ranks) <= before + 1e-9
    assert makespan(costs, refine_pairs(np.asarray(costs, float), start, ranks), ranks) <= before + 1e-9


@FAST
@given(any_costs, st.integers(1, 8), st.integers(1, 4), st.data())
def test_locality_keeps_balance_within_tolerance_and_moves_less(costs, ranks, per_node, data):
    sources = data.draw(st.lists(st.integers(0, ranks - 1), min_size=len(costs), max_size=len(costs)))
    per_node = min(per_node, ranks)
    on = plan_balance(costs, sources, ranks, ranks_per_node=per_node)
    off = plan_balance(costs, sources, ranks, ranks_per_node=per_node,
                       config=BalanceConfig(locality_tolerance=None))
    assert makespan(costs, on, ranks) <= makespan(costs, off, ranks) * 1.02 + 1e-9
    topo = Topology(num_ranks=ranks, ranks_per_node=per_node)
    assert transfer_bytes(on, sources, costs, topo) <= transfer_bytes(off, sources, costs, topo)
    assert on == plan_balance(costs, sources, ranks, ranks_per_node=per_node)  # deterministic


def test_locality_moves_close_to_the_minimum():
    rng = np.random.default_rng(0)
    ranks, per_rank = 64, 16
    costs = rng.lognormal(0, 0.8, ranks * per_rank)
    sources = np.repeat(np.arange(ranks), per_rank)
    topo = Topology(num_ranks=ranks, ranks_per_node=8)
    on = plan_balance(costs, sources, ranks, ranks_per_node=8)
    off = plan_balance(costs, sources, ranks, ranks_per_node=8, config=BalanceConfig(locality_tolerance=None))
    limit = 1.02 * makespan(costs, off, ranks)
    assert makespan(costs, on, ranks) <= limit
    # Any plan under `limit` moves at least each rank's excess over it; locality is within 10 % of that.
    must_move = np.maximum(0.0, loads(costs, sources, ranks) - limit).sum()
    inter_on, intra_on = transfer_bytes(on, sources, costs, topo)
    inter_off, intra_off = transfer_bytes(off, sources, costs, topo)
    assert inter_on + intra_on <= 1.1 * must_move
    assert (inter_on + intra_on) * 5 <= inter_off + intra_off
    assert inter_on * 10 <= inter_off  # inter-node bytes: more than an order of magnitude


def test_batched_lpt_meets_the_balance_goal_on_long_tail():
    rng = np.random.default_rng(1)
    for ranks, per_rank in ((256, 8), (512, 32)):
        lengths = np.minimum(rng.lognormal(6.5, 1.0, ranks * per_rank), 32768)
        costs = 24576 * lengths + lengths ** 2
        out = lpt_batched(costs, ranks)
        assert makespan(costs, out, ranks) <= 1.05 * lower_bound(costs, ranks)
        assert np.array_equal(out, lpt_batched(costs, ranks))


def test_karmarkar_karp_refuses_huge_instances():
    with pytest.raises(ValueError, match="lpt_batched"):
        karmarkar_karp(np.ones(100_000), 100)


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        BalanceConfig(method="greedy")
    with pytest.raises(ValueError, match="locality_tolerance"):
        BalanceConfig(locality_tolerance=1.5)
    with pytest.raises(ValueError, match="does not support cap"):
        balance([1, 2], 2, config=BalanceConfig(method="kk"), cap=5)
