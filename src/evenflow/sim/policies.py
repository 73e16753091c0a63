"""evenflow's own batching policies as schedules, computed by the package's real planners.

* [`shard()`][shard] -- how the loader splits a map-style epoch across ranks (seeded permutation, strided, no
  padding duplicates: 10 samples on 3 ranks -> 4, 3, 3), for all ranks at once.
* [`evenflow_schedule()`][evenflow_schedule] -- the ODB protocol, W ranks in one process:
  `evenflow.planning.run_epoch()` drives one [`evenflow.planning.RankPlanner`][evenflow.planning.RankPlanner] per rank,
  exactly as the runtime does.
* [`balanced_schedule()`][balanced_schedule] -- then, step by step,
  [`evenflow.balance.rebalance_step()`][evenflow.balance.rebalance_step] moves samples between the ranks' groups of that
  step (the loader's post-balancing policy); step count unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..planning import AlignmentConfig, GroupingConfig, SampleMeta, make_planners, run_epoch
from .schedule import Schedule

__all__ = ["shard", "evenflow_schedule", "balanced_schedule"]


def shard(num_samples: int, world_size: int, *, seed: int = 0, epoch: int = 0,
          shuffle: bool = True) -> list[np.ndarray]:
    """Every rank's sample ids for one epoch, as the loader deals them: ``perm[r::world_size]`` of the
    permutation seeded by ``[seed, epoch]`` (`evenflow.runtime.source.shard_indices()`, all ranks at once).

    >>> [s.tolist() for s in shard(5, 2, shuffle=False)]
    [[0, 2, 4], [1, 3]]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
             else np.arange(num_samples))
    return [order[r::world_size] for r in range(world_size)]


def evenflow_schedule(lengths: np.ndarray, *, world_size: int, grouping: GroupingConfig,
                      alignment: AlignmentConfig = AlignmentConfig(), seed: int = 0,
                      extra: Mapping[str, np.ndarray] | None = None, name: str = "evenflow_local") -> Schedule:
    """One epoch of the evenflow protocol over ``lengths`` (sample i has ``lengths[i]`` tokens).

    ``extra`` gives per-sample values for ``grouping.extra_budgets`` (e.g. image patches).
    The schedule's ``info`` holds the number of protocol rounds and IDLE slots.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    shards = shard(len(lengths), world_size, seed=seed)
    planners = make_planners(world_size, grouping, alignment, seed=seed)
    names = list(grouping.extra_budgets)
    extra_arr = {k: np.asarray(extra[k], dtype=np.int64) for k in names} if names else {}

    def stream(ids: np.ndarray):
        for i in ids.tolist():
            yield SampleMeta(i, int(lengths[i]), 0, tuple((k, int(extra_arr[k][i])) for k in names))

    trace = run_epoch(planners, [stream(s) for s in shards], unread=[len(s) for s in shards])
    steps = [[[it.key for it in slot] for slot in step] for step in trace.steps]
    idle = sum(1 for step in trace.steps for slot in step if not slot)
    info = {"rounds": len(trace.rounds), "idle_slots": idle,
            "dropped": sum(len(p.dropped) for p in planners), "alone": sum(len(p.alone) for p in planners)}
    return Schedule.from_steps(steps, world_size, layout=grouping.cost, name=name, info=info)


def balanced_schedule(schedule: Schedule, lengths: np.ndarray, *, token_budget: int, tolerance: float = 0.02,
                      pad_to_multiple_of: int | None = None, name: str = "evenflow_balanced") -> Schedule:
    """Rebalance every step of ``schedule`` across ranks with
    [`evenflow.balance.rebalance_step()`][evenflow.balance.rebalance_step].

    ``info["moved"]`` counts samples that changed rank (each is one sample shipped by the all-to-all).
    """
    from ..balance import rebalance_step

    lengths = np.asarray(lengths, dtype=np.int64)
    steps, moved = [], 0
    for step in schedule.batches():
        lens = [lengths[g].tolist() for g in step]
        new = rebalance_step(step, lens, budget=token_budget, cost=schedule.layout, tolerance=tolerance,
                             pad_to_multiple_of=pad_to_multiple_of)
        home = {i: r for r, g in enumerate(step) for i in g}
        moved += sum(1 for r, g in enumerate(new) for i in g if home[i] != r)
        steps.append(new)
    return Schedule.from_steps(steps, schedule.world_size, layout=schedule.layout, name=name,
                               info={**schedule.info, "moved": moved})
