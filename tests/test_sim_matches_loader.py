"""The simulator replays the loader exactly: same steps, same samples on the same rank, both planning policies.

The demo sizes its fixed arms from a planner-only dry run (evenflow.demo.plan) and benchmarks/quality_replay.py
trains on the simulated steps, so both are only as honest as this equality: real gloo ranks, the real loader,
and :func:`evenflow.sim.evenflow_schedule` / :func:`evenflow.sim.global_schedule` on the same lengths and seed.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch

import evenflow
from _dist import run_world
from _ids import IdsDataset
from evenflow.planning import AlignmentConfig, GroupingConfig
from evenflow.sim import evenflow_schedule, global_schedule

BUDGET = 1024


def _lengths(n: int = 500) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(5.5, 1.0, n).astype(np.int64), 8, BUDGET)




def _real_steps(rank, world, planning, buffer_size, accum=1):
    loader = evenflow.DynamicBatchLoader(IdsDataset(_lengths()), token_budget=BUDGET, buffer_size=buffer_size,
                                         planning=planning, seed=0, shuffle=True, timeout=timedelta(seconds=60),
                                         grad_accum_steps=accum)
    steps = []
    try:
        for batch in loader:
            info = evenflow.pop_step_info(batch)
            steps.append([] if info.is_idle else sorted(int(row[0]) for row in batch["input_ids"]))
    finally:
        loader.close()
    return steps


@pytest.mark.parametrize("planning,world,accum", [("local", 2, 1), ("global", 3, 1), ("global", 2, 2)])
def test_simulated_schedule_is_the_loaders(planning, world, accum):
    per_rank = run_world(_real_steps, world, planning, 32, accum, timeout=240)
    real = [list(step) for step in zip(*per_rank, strict=True)]  # [step][rank] -> sorted sample ids

    def simulated(grad_accum_steps):
        policy = global_schedule if planning == "global" else evenflow_schedule
        extra = {"grad_accum_steps": grad_accum_steps} if planning == "global" else {}
        schedule = policy(_lengths(), world_size=world, grouping=GroupingConfig(token_budget=BUDGET),
                          alignment=AlignmentConfig(buffer_size=32), seed=0, **extra)
        return [[sorted(int(i) for i in group) for group in step] for step in schedule.batches()]

    assert real == simulated(accum)
    if accum > 1:  # the loader hands its accumulation to the planner: the round order differs (NOTE [ Round order ])
        assert real != simulated(1)
