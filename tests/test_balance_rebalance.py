"""rebalance_step: the loader's per-step policy. Golden cases and hypothesis properties. Pure."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenflow.balance.rebalance import rebalance_step, step_costs

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _lengths(groups, table):
    return [[table[i] for i in g] for g in groups]


def test_golden_idle_rank_gets_work():
    # NOTE [ Rebalancing a step keeps every budget ]: [8, 8] | [3] | IDLE -> 8, 8, 3 (was 16, 3, 0).
    out = rebalance_step([["a", "b"], ["c"], []], [[8, 8], [3], []], budget=16)
    assert out == [["a"], ["c"], ["b"]]
    table = {"a": 8, "b": 8, "c": 3}
    assert step_costs(_lengths(out, table)) == [8, 3, 8]


def test_golden_balanced_input_is_untouched():
    groups = [[0, 1], [2, 3]]
    assert rebalance_step(groups, [[4, 4], [4, 4]], budget=8) == groups


def test_golden_summed():
    out = rebalance_step([["x", "y", "z"], ["w"]], [[6, 5, 4], [1]], budget=16, cost="summed")
    table = {"x": 6, "y": 5, "z": 4, "w": 1}
    assert sorted(step_costs(_lengths(out, table), cost="summed")) == [7, 9]  # {6, 1} | {5, 4}: optimal


def test_errors_name_rank_and_fix():
    with pytest.raises(ValueError, match=r"rank 0: its group already costs 20 > budget=16"):
        rebalance_step([[1, 2]], [[10, 10]], budget=16)
    with pytest.raises(ValueError, match=r"rank 1: 2 samples but 1 lengths"):
        rebalance_step([[1], [2, 3]], [[1], [1]], budget=16)
    with pytest.raises(ValueError, match=r"rank 0, sample 1 \('b'\): length 0 is not a positive integer"):
        rebalance_step([["a", "b"]], [[1, 0]], budget=16)
    with pytest.raises(ValueError, match="cost must be"):
        rebalance_step([[1]], [[1]], budget=4, cost="max")


@st.composite
def steps(draw):
    world = draw(st.integers(1, 6))
    budget = draw(st.integers(8, 200))
    multiple = draw(st.sampled_from([None, 1, 4]))
    cost = draw(st.sampled_from(["padded", "summed"]))
    groups, lengths, next_id = [], [], 0
    for _ in range(world):
        ls = []
        while draw(st.booleans()):
            ls.append(draw(st.integers(1, budget)))
            if step_costs([ls], cost=cost, pad_to_multiple_of=multiple)[0] > budget:
                ls.pop()
                break
        groups.append(list(range(next_id, next_id + len(ls))))
        lengths.append(ls)
        next_id += len(ls)
    return groups, lengths, budget, cost, multiple


@SETTINGS
@given(steps())
def test_properties(case):
    groups, lengths, budget, cost, multiple = case
    table = {i: ln for g, ls in zip(groups, lengths) for i, ln in zip(g, ls)}
    out = rebalance_step(groups, lengths, budget=budget, cost=cost, pad_to_multiple_of=multiple)
    # exactly once
    assert sorted(i for g in out for i in g) == sorted(table)
    assert len(out) == len(groups)
    before = step_costs(lengths, cost=cost, pad_to_multiple_of=multiple)
    after = step_costs(_lengths(out, table), cost=cost, pad_to_multiple_of=multiple)
    # every budget holds and the slowest rank never gets slower
    assert max(after) <= budget
    assert max(after) <= max(before)
    # IDLE ranks get work whenever someone holds two samples
    assert sum(1 for g in out if g) == min(len(table), len(groups))
    # deterministic, and ids keep (source rank, position) order inside a group
    assert out == rebalance_step(groups, lengths, budget=budget, cost=cost, pad_to_multiple_of=multiple)
    for g in out:
        assert g == sorted(g)


@SETTINGS
@given(steps())
def test_padded_is_optimal_against_brute_force(case):
    import itertools

    groups, lengths, budget, cost, multiple = case
    flat = [ln for ls in lengths for ln in ls]
    if cost != "padded" or len(flat) > 7:
        return
    world = len(groups)
    out = rebalance_step(groups, lengths, budget=budget, pad_to_multiple_of=multiple, tolerance=0.0)
    table = {i: ln for g, ls in zip(groups, lengths) for i, ln in zip(g, ls)}
    got = max(step_costs(_lengths(out, table), pad_to_multiple_of=multiple))
    best = min((max(step_costs([[flat[i] for i in range(len(flat)) if a[i] == r] for r in range(world)],
                               pad_to_multiple_of=multiple))
                for a in itertools.product(range(world), repeat=len(flat))), default=0)
    assert got == best
