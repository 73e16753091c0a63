"""The per-step fast path of plan_balance: sparse greedy matching against the exact assignment (the
reference), the early-stopping refinement against MILP, skewed instances, and no scipy on the default path."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

import evenflow.balance as B
from evenflow.balance import (BalanceConfig, Topology, assign_buckets, assign_buckets_greedy, lower_bound, lpt,
                              makespan, milp_balance, plan_balance, transfer_bytes)
from evenflow.balance.lpt import REFINE_GAP

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _kept(rank_of: np.ndarray, buckets: np.ndarray, sources: np.ndarray, w: np.ndarray) -> float:
    return float(w[rank_of[buckets] == sources].sum())


@FAST
@given(st.integers(1, 12), st.integers(0, 80), st.data())
def test_greedy_matching_keeps_at_least_half_of_the_exact_optimum(ranks, n, data):
    buckets = np.array(data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n)), dtype=np.int64)
    sources = np.array(data.draw(st.lists(st.integers(0, ranks - 1), min_size=n, max_size=n)), dtype=np.int64)
    w = np.array(data.draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)), dtype=np.float64)
    topo = Topology(num_ranks=ranks, ranks_per_node=ranks)
    greedy = assign_buckets_greedy(buckets, sources, topo, item_bytes=w)
    assert sorted(greedy.tolist()) == list(range(ranks))  # a permutation: every bucket its own rank
    home = np.zeros((ranks, ranks))
    np.add.at(home, (buckets, sources), w)
    r, c = linear_sum_assignment(-home)  # reference: the exact maximum of bytes kept in place
    best = home[r, c].sum()
    assert _kept(greedy, buckets, sources, w) >= 0.5 * best - 1e-9
    exact = assign_buckets(buckets, sources, topo, item_bytes=w)
    assert _kept(exact, buckets, sources, w) == pytest.approx(best)


def test_greedy_matching_is_exact_on_typical_steps_and_prefers_the_node():
    rng = np.random.default_rng(0)
    gaps = []
    for trial in range(20):
        ranks, per_node = 32, 8
        lengths = np.minimum(rng.lognormal(6.6, 1.0, ranks * 32).astype(np.int64) + 1, 32768)
        costs = 24576.0 * lengths + lengths.astype(np.float64) ** 2
        sources = np.repeat(np.arange(ranks), 32)
        buckets = B.balance(costs, ranks)
        topo = Topology(num_ranks=ranks, ranks_per_node=per_node)
        g = transfer_bytes(assign_buckets_greedy(buckets, sources, topo, item_bytes=lengths)[buckets], sources,
                           lengths, topo)
        e = transfer_bytes(assign_buckets(buckets, sources, topo, item_bytes=lengths)[buckets], sources, lengths,
                           topo)
        gaps.append((g[0] + g[1]) / max(e[0] + e[1], 1.0))
        assert g[0] <= 1.05 * e[0] + 1  # inter-node bytes within 5 % of the exact lexicographic optimum
    assert float(np.median(gaps)) <= 1.02


@FAST
@given(st.lists(st.integers(0, 40), min_size=0, max_size=9), st.integers(1, 4))
def test_early_stopping_refinement_stays_near_the_milp_optimum(costs, ranks):
    opt = makespan(costs, milp_balance(costs, ranks), ranks)
    got = makespan(costs, lpt(costs, ranks), ranks)
    # refinement stops within REFINE_GAP of the lower bound, or at a local optimum; never worse than LPT's 4/3
    assert got <= max(4 / 3 * opt, lower_bound(costs, ranks) * (1 + REFINE_GAP)) + 1e-9


def _skewed(ranks: int, per_rank: int, seed: int, share: float = 0.8):
    rng = np.random.default_rng(seed)
    n = ranks * per_rank
    lengths = np.minimum(rng.lognormal(6.6, 1.0, n).astype(np.int64) + 1, 32768)
    sources = np.where(rng.random(n) < share, 0, rng.integers(0, ranks, n))
    return 24576.0 * lengths + lengths.astype(np.float64) ** 2, sources, lengths


@pytest.mark.parametrize("ranks", [64, 512])
def test_skewed_instance_balances_and_keeps_what_it_can(ranks):
    costs, sources, lengths = _skewed(ranks, 32, seed=ranks)
    dest = np.asarray(plan_balance(costs, sources, ranks, ranks_per_node=8, item_bytes=lengths))
    off = np.asarray(plan_balance(costs, sources, ranks, ranks_per_node=8, item_bytes=lengths,
                                  config=BalanceConfig(locality_tolerance=None)))
    assert makespan(costs, dest, ranks) <= 1.02 * makespan(costs, off, ranks) + 1e-6
    assert makespan(costs, dest, ranks) <= 1.05 * lower_bound(costs, ranks)
    topo = Topology(num_ranks=ranks, ranks_per_node=8)
    assert transfer_bytes(dest, sources, lengths, topo) <= transfer_bytes(off, sources, lengths, topo)
    exact = np.asarray(plan_balance(costs, sources, ranks, ranks_per_node=8, item_bytes=lengths,
                                    config=BalanceConfig(assignment="exact")))
    assert makespan(costs, exact, ranks) == pytest.approx(makespan(costs, dest, ranks), rel=0.02)


def test_default_path_imports_no_scipy_and_warm_up_runs():
    code = ("import sys, numpy as np; import evenflow.balance as b; b.warm_up(); "
            "c = np.arange(1, 2049, dtype=float); s = np.repeat(np.arange(64), 32); "
            "b.plan_balance(c, s, 64, ranks_per_node=8); print('scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", "the per-step path imported scipy (a ~1 s first-call stall)"


def test_64_ranks_x_32_items_is_fast_after_warm_up():
    # Goal: well under 10 ms on one idle core. On a shared, loaded CI machine assert a loose CPU-time bound
    # (the benchmark reports the real figure); the old dense path took ~119 ms on a quiet core.
    rng = np.random.default_rng(3)
    lengths = np.minimum(rng.lognormal(6.6, 1.0, 64 * 32).astype(np.int64) + 1, 32768)
    costs = 24576.0 * lengths + lengths.astype(np.float64) ** 2
    sources = np.repeat(np.arange(64), 32)
    B.warm_up()
    best = np.inf
    for _ in range(7):
        t0 = time.process_time()
        plan_balance(costs, sources, 64, ranks_per_node=8, item_bytes=lengths)
        best = min(best, time.process_time() - t0)
    assert best < 0.040, f"plan_balance 64 x 32 took {best * 1e3:.1f} ms of CPU"


def test_config_rejects_unknown_assignment():
    with pytest.raises(ValueError, match="assignment must be 'greedy' or 'exact'"):
        BalanceConfig(assignment="hungarian")
