"""Quota mode under global planning never yields an IDLE batch while a sample could carry instead (NOTE [ The
alignment rule ]; NOTE [ Drain sized from the remaining work ]), and the change leaves every other plan alone.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

import evenflow
from _dist import run_world
from evenflow.planning.grouping import GroupingConfig
from evenflow.planning.pooled.plan import GlobalPlanConfig, plan_global_round
from evenflow.planning.timecost import default_time_cost

# The last round of a quota-mode epoch, as 2-rank worlds planned it: (cost, budget, max_samples, lengths, sources).
# Each drained into ceil(G / W) steps, one more than its items fill: one rank trained an IDLE batch.
DRAINS = [("padded", 64, None, [45, 2, 43, 40, 45], [0, 0, 0, 1, 1]),
          ("summed", 128, 4, [125, 122, 104], [0, 1, 1]),
          ("summed", 32, 4, [17, 28, 24, 28, 17, 19, 24, 27, 23, 16, 31, 28, 25, 19, 17], [0] * 9 + [1] * 6)]


def _config(cost, budget, most, join, **kw):
    return GlobalPlanConfig(grouping=GroupingConfig(token_budget=budget, cost=cost, max_samples=most),
                            time_cost=default_time_cost(cost), join=join, **kw)


def _sizes(plan):
    return [[len(slot) for slot in step] for step in plan.slots()]


@pytest.mark.parametrize("case", range(len(DRAINS)))
def test_a_quota_drain_emits_whole_steps_and_carries_the_rest(case):
    cost, budget, most, lengths, sources = DRAINS[case]
    joined = plan_global_round(lengths, sources, 2, config=_config(cost, budget, most, True), final=True)
    assert any(0 in step for step in _sizes(joined))  # join mode trains everything: its drain has an IDLE slot
    quota = plan_global_round(lengths, sources, 2, config=_config(cost, budget, most, False), final=True)
    assert all(0 not in step for step in _sizes(quota)), _sizes(quota)
    assert quota.num_steps == len(lengths) // 2 and len(quota.kept) == len(lengths) % 2  # the rest carries


def test_quota_plans_differ_from_join_plans_only_where_join_would_idle():
    rng = np.random.default_rng(11)
    changed = 0
    for t in range(150):
        cost = ("padded", "summed")[t % 2]
        world, budget = int(rng.integers(2, 5)), int(rng.choice([32, 64, 256]))
        n = int(rng.integers(world, 50))
        lengths = np.where(rng.random(n) < 0.5, rng.integers(1, 4, n), rng.integers(budget // 2, budget + 1, n))
        sources = rng.integers(0, world, n)
        final = bool(t % 3)
        kw = dict(max_steps=int(rng.choice([2, 8])), grad_accum_steps=int(rng.choice([1, 2])))
        plans = [plan_global_round(lengths, sources, world, config=_config(cost, budget, None, join, **kw),
                                   final=final) for join in (True, False)]
        quota = _sizes(plans[1])
        assert all(0 not in step for step in quota), (t, quota)
        if all(0 not in step for step in _sizes(plans[0])):
            assert np.array_equal(plans[0].step, plans[1].step) and np.array_equal(plans[0].dest, plans[1].dest), t
        else:
            changed += 1
    assert changed  # the set above holds drains that joined with an IDLE slot


class _Rows(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.full((int(self.lengths[i]),), 5), "idx": i}


# Loader configurations that yielded an IDLE batch in quota mode (2 ranks, 2 epochs): (seed, cost, budget, n,
# max_samples, buffer_size); lengths half 1-3 tokens, half between budget / 2 and the budget.
EPOCHS = 2
WORLDS = [(223523, "padded", 64, 107, None, 4), (837360, "summed", 32, 76, 4, 64)]


def _quota_epochs(rank, world):
    out = []
    for seed, cost, budget, n, most, buffer in WORLDS:
        rng = np.random.default_rng(seed)
        lengths = np.where(rng.random(n) < 0.5, rng.integers(1, 4, n), rng.integers(budget // 2, budget, n))
        loader = evenflow.DynamicBatchLoader(_Rows(lengths), token_budget=budget, cost=cost, join=False,
                                             buffer_size=buffer, max_samples=most, seed=seed, planning="global",
                                             timeout=timedelta(seconds=60))
        idle, trained = 0, []
        for epoch in range(EPOCHS):
            loader.set_epoch(epoch)
            for batch in loader:
                info = evenflow.pop_step_info(batch)
                idle += info.is_idle
                trained += [] if info.is_idle else [int(i) for i in batch["idx"]]
        out.append({"idle": idle, "trained": trained, "carry": [int(k[1]) for k in loader.state_dict()["next_carry"]]})
        loader.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quota_epochs_under_global_planning_yield_no_idle_batch_and_lose_nothing():
    res = run_world(_quota_epochs, 2, timeout=240)
    for k, (_, _, _, n, _, _) in enumerate(WORLDS):
        assert [r[k]["idle"] for r in res] == [0, 0], (WORLDS[k], [r[k]["idle"] for r in res])
        counts = np.bincount([i for r in res for i in r[k]["trained"] + r[k]["carry"]], minlength=n)
        assert (counts == EPOCHS).all(), (WORLDS[k], np.flatnonzero(counts != 3))  # each sample once an epoch
