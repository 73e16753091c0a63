"""Grouping planner: golden tables, optimality against oracles, budgets, oversize policies, bad input.

Oracles written here, independent of the planner:
- padded cost: a dynamic program over every partition of the length-sorted input (stable: ties by position)
  into contiguous runs -- the planner must reach exactly its minimum number of groups;
- summed cost: a plain first-fit-decreasing -- the planner must never use more groups.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import evenflow
from evenflow.planning.grouping import GroupingConfig, plan, plan_groups

# -- independent reference implementations -------------------------------------------------------------------


def round_up(x: int, multiple: int | None) -> int:
    return x if not multiple else -(-x // multiple) * multiple


def group_fits(members, lengths, *, token_budget, cost="padded", max_samples=None, extra=None,
               extra_budgets=None, pad_to_multiple_of=None) -> bool:
    """Does this group respect every budget? Padded cost uses the group's *own* longest sample."""
    ls = [int(lengths[i]) for i in members]
    if cost == "padded":
        c = len(ls) * round_up(max(ls), pad_to_multiple_of)
    else:
        c = round_up(sum(ls), pad_to_multiple_of)
    if c > token_budget or (max_samples is not None and len(ls) > max_samples):
        return False
    return all(sum(int(extra[name][i]) for i in members) <= cap for name, cap in (extra_budgets or {}).items())


def dp_min_contiguous_groups(lengths, **budgets) -> int:
    """Minimum number of contiguous runs of the stably length-sorted input such that every run fits."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    best = [0] + [math.inf] * len(order)
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):  # run order[i:j]; growing it never makes it fit again
            if not group_fits(order[i:j], lengths, **budgets):
                break
            best[j] = min(best[j], best[i] + 1)
    return best[-1]


def ffd_reference(lengths, *, token_budget, max_samples=None, extra=None, extra_budgets=None,
                  pad_to_multiple_of=None) -> list[list[int]]:
    """Textbook first-fit-decreasing for the summed cost: longest first, into the first group it fits."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g in groups:
            if group_fits(g + [i], lengths, token_budget=token_budget, cost="summed", max_samples=max_samples,
                          extra=extra, extra_budgets=extra_budgets, pad_to_multiple_of=pad_to_multiple_of):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def assert_partition(groups, n, missing=()):
    flat = [i for g in groups for i in g]
    assert sorted(flat) == sorted(set(range(n)) - set(missing)), "every kept index exactly once"
    assert all(g for g in groups), "no empty group"


# -- golden tables ---------------------------------------------------------------------------------------------

GOLDEN = [
    # lengths, keyword arguments, expected groups
    ([2, 6, 3, 2, 6, 3], dict(token_budget=12), [[1, 4], [0, 3, 2, 5]]),
    ([100, 4000, 120, 3900], dict(token_budget=8000), [[3, 1], [0, 2]]),
    ([4000, 100], dict(token_budget=4096), [[0], [1]]),  # own longest: 2 x 4000 > 4096
    ([100, 4000, 100], dict(token_budget=8000), [[2, 1], [0]]),  # top run of the sorted list: 2 x 4000
    ([5, 5, 5, 5, 5], dict(token_budget=100, max_samples=2), [[3, 4], [1, 2], [0]]),
    ([5, 5, 5], dict(token_budget=16), [[0, 1, 2]]),
    ([5, 5, 5], dict(token_budget=16, pad_to_multiple_of=8), [[1, 2], [0]]),  # costs 2 x 8, not 3 x 5
    ([4, 4, 4, 4], dict(token_budget=100, extra={"patches": [10, 0, 10, 0]}, extra_budgets={"patches": 10}),
     [[1, 2, 3], [0]]),
    ([6, 5, 4, 3, 2], dict(token_budget=10, cost="summed"), [[0, 2], [1, 3, 4]]),
    ([5, 5, 5], dict(token_budget=16, cost="summed", pad_to_multiple_of=8), [[0, 1, 2]]),  # 15 -> 16
    ([5, 5, 5], dict(token_budget=15, cost="summed", pad_to_multiple_of=8), [[0], [1], [2]]),  # 10 -> 16 > 15
    ([6, 5, 4, 3, 2], dict(token_budget=10, cost="summed", max_samples=2), [[0, 2], [1, 3], [4]]),
    ([3, 20, 4], dict(token_budget=10, oversize="alone"), [[0, 2], [1]]),
    ([], dict(token_budget=10), []),
]


@pytest.mark.parametrize("lengths,kwargs,expected", GOLDEN)
def test_golden(lengths, kwargs, expected):
    assert plan_groups(lengths, **kwargs) == expected
    assert plan_groups(np.asarray(lengths, dtype=np.int64), **kwargs) == expected


def test_golden_drop():
    with pytest.warns(UserWarning):
        assert plan_groups([3, 20, 4], token_budget=10, oversize="drop") == [[0, 2]]


def test_optimal_on_realistic_long_tail():
    """CV 2.4 chat-like lengths: padded grouping reaches the DP minimum; summed beats or ties FFD."""
    rng = np.random.default_rng(0)
    sigma = math.sqrt(math.log(1 + 2.4 ** 2))
    lengths = np.clip(np.rint(rng.lognormal(math.log(400) - sigma ** 2 / 2, sigma, 500)), 1, 4096).astype(int)
    groups = plan_groups(lengths, token_budget=4096)
    assert_partition(groups, len(lengths))
    assert len(groups) == dp_min_contiguous_groups(lengths.tolist(), token_budget=4096)
    summed = plan_groups(lengths, token_budget=4096, cost="summed")
    assert_partition(summed, len(lengths))
    assert len(summed) <= len(ffd_reference(lengths.tolist(), token_budget=4096))


# -- properties against the oracles ----------------------------------------------------------------------------


@st.composite
def grouping_cases(draw, cost):
    budget = draw(st.integers(1, 300))
    pad = draw(st.none() | st.integers(1, budget))
    longest = budget if pad is None else (budget // pad) * pad  # every sample fits on its own
    n = draw(st.integers(0, 40))
    # A few repeated values make ties (the stable order matters), the rest spread over the whole range.
    common = draw(st.lists(st.integers(1, longest), min_size=1, max_size=3))
    lengths = draw(st.lists(st.integers(1, longest) | st.sampled_from(common), min_size=n, max_size=n))
    max_samples = draw(st.none() | st.integers(1, 8))
    caps = {f"res{k}": draw(st.integers(1, 60)) for k in range(draw(st.integers(0, 2)))}
    extra = {name: draw(st.lists(st.integers(0, cap), min_size=n, max_size=n)) for name, cap in caps.items()}
    return lengths, dict(token_budget=budget, cost=cost, max_samples=max_samples, extra=extra,
                         extra_budgets=caps, pad_to_multiple_of=pad)


@settings(max_examples=250, deadline=None)
@given(grouping_cases("padded"))
def test_padded_is_minimum_over_contiguous_partitions(case):
    lengths, kw = case
    groups = plan_groups(lengths, **kw)
    assert_partition(groups, len(lengths))
    budgets = {k: v for k, v in kw.items() if k != "cost"}
    for g in groups:
        assert group_fits(g, lengths, **kw), (g, [lengths[i] for i in g])
    assert len(groups) == dp_min_contiguous_groups(lengths, **budgets)


@settings(max_examples=250, deadline=None)
@given(grouping_cases("summed"))
def test_summed_never_worse_than_first_fit_decreasing(case):
    lengths, kw = case
    groups = plan_groups(lengths, **kw)
    assert_partition(groups, len(lengths))
    for g in groups:
        assert group_fits(g, lengths, **kw), (g, [lengths[i] for i in g])
    reference = ffd_reference(lengths, **{k: v for k, v in kw.items() if k != "cost"})
    assert len(groups) <= len(reference)
    cap = (kw["token_budget"] // (kw["pad_to_multiple_of"] or 1)) * (kw["pad_to_multiple_of"] or 1)
    assert len(groups) >= -(-sum(lengths) // cap)  # no planner beats the volume bound


def best_fit_one_at_a_time(lengths, order, cap):
    """Best fit decreasing as written in the textbook: each sample to the group with the least room that holds it
    (ties: the lowest group), else a new group."""
    rooms, groups = [], []
    for i in order.tolist():
        fits = [g for g, room in enumerate(rooms) if room >= lengths[i]]
        if fits:
            g = min(fits, key=lambda g: (rooms[g], g))
            groups[g].append(i)
            rooms[g] -= int(lengths[i])
        else:
            groups.append([i])
            rooms.append(cap - int(lengths[i]))
    return groups


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 120), st.lists(st.integers(1, 6), max_size=80), st.integers(1, 40), st.randoms(use_true_random=False))
def test_best_fit_by_runs_equals_one_at_a_time(cap, units, unit, rnd):
    # _best_fit_decreasing places a run of equal lengths at once (the speed of the summed planner at 2,560
    # ranks); repeated lengths, exact fits and full groups are where that could differ from one sample at a time.
    from evenflow.planning.grouping import _best_fit_decreasing

    lengths = np.minimum(np.asarray(units, dtype=np.int64) * unit, cap)
    subset = np.asarray(sorted(rnd.sample(range(lengths.size), rnd.randint(0, lengths.size))), dtype=np.int64)
    order = subset[np.argsort(-lengths[subset], kind="stable")]
    assert _best_fit_decreasing(lengths, order, cap) == best_fit_one_at_a_time(lengths, order, cap)


@settings(max_examples=100, deadline=None)
@given(grouping_cases("padded"), st.sampled_from(["padded", "summed"]), st.randoms(use_true_random=False))
def test_deterministic_and_independent_of_container(case, cost, rnd):
    lengths, kw = case
    kw = {**kw, "cost": cost}
    first = plan_groups(lengths, **kw)
    assert plan_groups(list(lengths), **kw) == first
    assert plan_groups(np.asarray(lengths, dtype=np.int64), **kw) == first
    assert plan_groups(np.asarray(lengths, dtype=np.float64), **kw) == first  # integral floats are accepted
    # A permuted input gives the same groups up to relabelling when lengths (and resources) are distinct.
    perm = list(range(len(lengths)))
    rnd.shuffle(perm)
    if len(set(lengths)) == len(lengths) and not kw["extra_budgets"]:
        shuffled = plan_groups([lengths[p] for p in perm], **kw)
        relabel = sorted(sorted(perm[i] for i in g) for g in shuffled)
        assert relabel == sorted(sorted(g) for g in first)


# -- the public contract ---------------------------------------------------------------------------------------


def test_public_contract():
    assert evenflow.plan_groups is plan_groups
    lengths = [7, 300, 12, 12, 4096, 1, 80]
    for cost in ("padded", "summed"):
        for max_samples in (None, 2):
            groups = evenflow.plan_groups(lengths, token_budget=4096, cost=cost, max_samples=max_samples,
                                          oversize="error")
            assert isinstance(groups, list) and all(isinstance(g, list) for g in groups)
            assert all(type(i) is int for g in groups for i in g)  # plain ints, not numpy scalars
            assert_partition(groups, len(lengths))
            assert all(group_fits(g, lengths, token_budget=4096, cost=cost, max_samples=max_samples)
                       for g in groups)


# -- over-budget samples ---------------------------------------------------------------------------------------


def test_oversize_error_names_index_length_budget_and_knob():
    with pytest.raises(ValueError) as info:
        plan_groups([3, 20, 4], token_budget=10)
    msg = str(info.value)
    assert "sample 1" in msg and "length 20" in msg and "token_budget=10" in msg
    assert "oversize='alone'" in msg and "oversize='drop'" in msg and "raise token_budget" in msg


def test_oversize_error_with_padding_and_labels():
    with pytest.raises(ValueError, match=r"sample 9: length 9 \(padded to 16\) exceeds token_budget=12"):
        plan([3, 9], GroupingConfig(token_budget=12, pad_to_multiple_of=8), labels=[4, 9])


def test_oversize_error_on_extra_budget():
    with pytest.raises(ValueError) as info:
        plan_groups([3, 4], token_budget=10, extra={"patches": [10, 500]}, extra_budgets={"patches": 100})
    msg = str(info.value)
    assert "sample 1" in msg and "patches=500" in msg and "extra_budgets['patches']=100" in msg
    assert "oversize=" in msg


@pytest.mark.parametrize("cost", ["padded", "summed"])
def test_oversize_alone_gets_its_own_counted_group(cost):
    result = plan([3, 20, 4, 11, 2], GroupingConfig(token_budget=10, cost=cost, oversize="alone"))
    assert result.alone == [1, 3] and result.dropped == []
    assert [1] in result.groups and [3] in result.groups
    assert_partition(result.groups, 5)
    for g in result.groups:
        assert g in ([1], [3]) or group_fits(g, [3, 20, 4, 11, 2], token_budget=10, cost=cost)


def test_oversize_drop_is_counted_and_reported_once(caplog):
    with caplog.at_level(logging.DEBUG, logger="evenflow"):
        with pytest.warns(UserWarning, match=r"dropped 2 over-budget sample\(s\) \[1, 3\]") as caught:
            result = plan([3, 20, 4, 11, 2], GroupingConfig(token_budget=10, oversize="drop"))
    assert result.dropped == [1, 3] and result.alone == [] and len(caught) == 1
    assert_partition(result.groups, 5, missing=[1, 3])
    records = [r for r in caplog.records if r.name == "evenflow"]
    # One WARNING-level report (the warning); the log record is DEBUG, so no handler prints it a second time.
    assert [r.levelno for r in records] == [logging.DEBUG] and "oversize='drop'" in records[0].getMessage()


def test_no_oversize_no_warning(recwarn):
    plan_groups([3, 4], token_budget=10, oversize="drop")
    assert not recwarn.list


# -- bad input -------------------------------------------------------------------------------------------------

BAD_LENGTHS = [
    ([0, 3], r"sample 0: length 0 is not positive"),
    ([4, -3], r"sample 1: length -3 is not positive"),
    ([2, 2.5], r"sample 1: length 2.5 is not an integer"),
    ([float("nan")], r"sample 0: length nan is not an integer"),
    ([float("inf")], r"sample 0: length inf is not an integer"),
    (["a"], r"sample 0: length 'a' is not an integer"),
    ([3, None], r"sample 1: length None is not an integer"),
    ([True, False], r"sample 0: length True is not an integer"),
    ([[1, 2], [3, 4]], r"1-D sequence of integers, got shape \(2, 2\)"),
]


@pytest.mark.parametrize("lengths,match", BAD_LENGTHS)
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        plan_groups(lengths, token_budget=100)


BAD_CONFIG = [
    (dict(token_budget=0), r"token_budget must be > 0, got 0"),
    (dict(token_budget=-8), r"token_budget must be > 0"),
    (dict(token_budget=True), r"token_budget must be an integer, got True"),
    (dict(token_budget=8.5), r"token_budget must be an integer"),
    (dict(token_budget="8"), r"token_budget must be an integer"),
    (dict(token_budget=8, cost="tokens"), r"cost must be 'padded' or 'summed'"),
    (dict(token_budget=8, oversize="skip"), r"oversize must be 'error', 'alone' or 'drop'"),
    (dict(token_budget=8, max_samples=0), r"max_samples must be a positive integer or None"),
    (dict(token_budget=8, max_samples=True), r"max_samples must be a positive integer or None"),
    (dict(token_budget=8, max_samples=2.0), r"max_samples must be a positive integer or None"),
    (dict(token_budget=8, pad_to_multiple_of=0), r"pad_to_multiple_of must be a positive integer"),
    (dict(token_budget=8, pad_to_multiple_of=16), r"pad_to_multiple_of=16 exceeds token_budget=8"),
    (dict(token_budget=8, extra_budgets={"patches": 0}), r"extra_budgets\['patches'\] must be a positive"),
    (dict(token_budget=8, extra_budgets={"patches": True}), r"extra_budgets\['patches'\] must be a positive"),
]


@pytest.mark.parametrize("kwargs,match", BAD_CONFIG)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_groups([1, 2, 3], **kwargs)
    with pytest.raises(ValueError, match=match):
        GroupingConfig(**{k: v for k, v in kwargs.items()})


BAD_EXTRA = [
    (dict(extra_budgets={"patches": 10}), r"extra_budgets names \['patches'\] but no per-sample values"),
    (dict(extra={"patches": [1, 2]}, extra_budgets={"patches": 10}), r"has shape \(2,\), expected \(3,\)"),
    (dict(extra={"patches": [1, -2, 0]}, extra_budgets={"patches": 10}), r"sample 1: patches=-2 is negative"),
]


@pytest.mark.parametrize("kwargs,match", BAD_EXTRA)
def test_bad_extra_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_groups([1, 2, 3], token_budget=8, **kwargs)
