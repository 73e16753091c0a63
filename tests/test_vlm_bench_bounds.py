"""The lower bound benchmarks/vlm/bench_vlm.py scores the split plans against (``pigeonhole_bound``) is a lower bound:
never above the exact optimum (a MILP on small cases), and above the indivisible-item bound where a rank holds a
few equal pieces -- the case that bounds the audio phase at the first part's budgets."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from evenflow.balance.planners import makespan, milp_balance

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_vlm():
    sys.path.insert(0, str(BENCHMARKS))  # benchmarks/ holds vlm/ and the common/world it imports
    yield importlib.import_module("vlm.bench_vlm")
    sys.path.remove(str(BENCHMARKS))


def test_never_above_the_exact_optimum(bench_vlm):
    rng = np.random.default_rng(0)
    tight = 0
    for _ in range(150):
        world = int(rng.integers(1, 5))
        costs = rng.choice([1.0, 2.0, 3.0, 5.0], size=int(rng.integers(1, 9)))
        best = makespan(costs, milp_balance(costs, world), world) / (costs.sum() / world)
        bound = bench_vlm.pigeonhole_bound(costs, world)
        assert bound <= best + 1e-9, (costs, world)
        tight += bound > best - 1e-9
    assert tight > 75  # and it is the optimum on most of these small cases


def test_equal_pieces(bench_vlm):
    # 21 equal 2-s pieces on 4 ranks: some rank holds 6, so 6 / 5.25 -- the indivisible bound says 1.0
    assert bench_vlm.pigeonhole_bound(np.ones(21), 4) == pytest.approx(6 / 5.25)
    assert bench_vlm.pigeonhole_bound(np.ones(20), 4) == pytest.approx(1.0)
    assert bench_vlm.pigeonhole_bound(np.array([9.0, 1.0, 1.0]), 2) == pytest.approx(9 / 5.5)  # one item bounds
