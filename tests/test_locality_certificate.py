"""The locality pass's early give-up (``_cannot_fit`` in evenflow/balance/locality.py) changes no plan: it only
refuses tries that no placement could fit. Oracles: brute force on tiny cases, and every plan equal with the
certificate switched off."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from evenflow.balance import BalanceConfig, plan_balance
from evenflow.balance import locality

pytestmark = pytest.mark.timeout(120)


def _fits_somehow(sizes: np.ndarray, loads: np.ndarray, limit: float) -> bool:
    for dest in itertools.product(range(loads.size), repeat=sizes.size):
        if (loads + np.bincount(dest, weights=sizes, minlength=loads.size)).max() <= limit:
            return True
    return False


def test_the_docstring_example_and_a_fit():
    assert locality._cannot_fit(np.array([3.0, 3.0, 3.0]), np.array([5.0, 5.0]), 10.0)      # 3 items, 2 slots
    assert not locality._cannot_fit(np.array([3.0, 3.0]), np.array([5.0, 5.0]), 10.0)
    assert not locality._cannot_fit(np.zeros(0), np.array([5.0]), 10.0)


def test_it_never_refuses_what_some_placement_fits():
    rng = np.random.default_rng(0)
    refused = 0
    for _ in range(400):
        sizes = -np.sort(-rng.choice([1.0, 2.0, 3.0, 4.5], size=int(rng.integers(1, 6))))
        loads = rng.uniform(0, 6, size=int(rng.integers(1, 4)))
        limit = float(rng.uniform(4, 10))
        if locality._cannot_fit(sizes, loads, limit):
            refused += 1
            assert not _fits_somehow(sizes, loads, limit), (sizes, loads, limit)
    assert refused > 50  # the oracle saw refusals, not only passes


def test_plans_are_the_same_with_and_without_it(monkeypatch):
    rng = np.random.default_rng(1)
    cases = []
    for case in range(300):
        world = int(rng.choice([2, 4, 8, 16, 64]))
        n = int(rng.integers(1, 10 * world))
        costs = rng.choice([1.0, 2.0, 4.0], n) if case % 2 else rng.lognormal(0, 1, n)
        sources = np.minimum(rng.integers(0, world, n), max(1, world // (1 + case % 4)))
        per_node = world if case % 3 else max(1, world // 2)
        cases.append((costs, sources, world, per_node, BalanceConfig(locality_tolerance=[0.0, 0.02, 0.1][case % 3])))

    def plans():
        return [plan_balance(c, s, w, ranks_per_node=p, config=cfg) for c, s, w, p, cfg in cases]

    calls = []
    real = locality._cannot_fit
    monkeypatch.setattr(locality, "_cannot_fit", lambda *a: calls.append(real(*a)) or calls[-1])
    with_it = plans()
    monkeypatch.setattr(locality, "_cannot_fit", lambda *a: False)
    assert plans() == with_it
    assert sum(calls) > 10  # it did refuse tries on these cases


def _tries(monkeypatch, fits: set[float], limit: float = 100.0) -> tuple[list[float], np.ndarray | None]:
    """The keep thresholds ``_first_fit`` tries (as fractions of the limit) when exactly ``fits`` succeed."""
    tried = []

    def fake(costs, weights, sources, prefix, num_ranks, keep_limit, limit_, room, topology):
        tried.append(round(keep_limit / limit_, 6))
        return np.full(1, tried[-1]) if tried[-1] in fits else None

    monkeypatch.setattr(locality, "_home_plan", fake)
    plan = locality._first_fit(None, None, None, None, 1, limit, np.inf, None)
    return tried, plan


def test_thresholds_tried_full_limit_first_then_lowest_then_between(monkeypatch):
    full, *between, lowest = locality.LOCALITY_KEEP_FRACTIONS
    assert _tries(monkeypatch, {full}) == ([full], np.full(1, full))                      # one try when it fits
    tried, plan = _tries(monkeypatch, set())                                             # nothing fits: two tries
    assert tried == [full, lowest] and plan is None
    tried, plan = _tries(monkeypatch, {between[1], lowest})                               # the highest that fits
    assert tried == [full, lowest, between[0], between[1]] and plan[0] == between[1]
    tried, plan = _tries(monkeypatch, {lowest})
    assert tried == [full, lowest, *between] and plan[0] == lowest
    # Given up although a middle threshold would fit (greedy placement is not monotone): the documented cost.
    assert _tries(monkeypatch, {between[0]}) == ([full, lowest], None)
