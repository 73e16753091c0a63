"""The global planning policy as a schedule: W ranks' buffers planned together every round.

Each rank reads its own shard (the same seeded sharding as the loader, [`evenflow.sim.shard()`][evenflow.sim.shard])
into a buffer under the local protocol's fill rule (``buffer_size`` samples, or the warm-up token count of
``AlignmentConfig.warmup_budgets``); then one
[`evenflow.planning.plan_global_round()`][evenflow.planning.plan_global_round] over the union of all buffers decides the
round's T steps for every rank; emitted samples leave their buffers, the rest age by one round. ``final`` is set once
every stream is exhausted, so the drain is sized from the remaining work (NOTE [ Drain sized from the remaining work ]).

``info["moved"]`` counts samples trained on a rank other than the one that read them (each one crosses the
all-to-all once); ``info["moved_bytes"]`` sums their lengths (tokens as a stand-in for bytes).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..planning import AlignmentConfig, GroupingConfig
from ..planning.pooled.plan import EpochProgress, GlobalPlanConfig, plan_global_round
from ..planning.timecost import TimeCost, default_time_cost
from .policies import shard
from .schedule import Schedule

__all__ = ["global_schedule"]


class _Buffers:
    """Every rank's buffer as flat arrays (sample id, source rank, age), refilled from the shards."""

    def __init__(self, shards: list[np.ndarray], lengths: np.ndarray, alignment: AlignmentConfig,
                 token_budget: int) -> None:
        self.shards, self.lengths, self.alignment, self.budget = shards, lengths, alignment, token_budget
        self.read = [0] * len(shards)
        self.ids = np.zeros(0, dtype=np.int64)
        self.src = np.zeros(0, dtype=np.int64)
        self.age = np.zeros(0, dtype=np.int64)

    @property
    def exhausted(self) -> bool:
        return all(r == len(s) for r, s in zip(self.read, self.shards))

    def fill(self, round_index: int) -> None:
        """Each rank reads until its buffer is full by the local fill rule (samples, or warm-up tokens)."""
        held = np.bincount(self.src, minlength=len(self.shards))
        tokens = np.bincount(self.src, weights=self.lengths[self.ids], minlength=len(self.shards))
        warm = self.alignment.warmup_budgets
        goal_tokens = (np.inf if warm is None
                       else (warm + round_index * self.alignment.max_steps_per_round) * self.budget)
        new_ids, new_src = [], []
        for r, ids in enumerate(self.shards):
            room = self.alignment.buffer_size - int(held[r])
            start = self.read[r]
            if room <= 0 or start >= len(ids) or tokens[r] >= goal_tokens:
                continue
            # read while below both the sample and the token goal (the sample that crosses is read)
            cum = tokens[r] + np.cumsum(self.lengths[ids[start:start + room]])
            take = min(cum.size, int(np.searchsorted(cum, goal_tokens, side="left")) + 1)
            new_ids.append(ids[start:start + take])
            new_src.append(np.full(take, r, dtype=np.int64))
            self.read[r] = start + take
        if new_ids:
            order = np.argsort(np.concatenate((self.src, *new_src)), kind="stable")  # rank-major, arrival order
            self.ids = np.concatenate((self.ids, *new_ids))[order]
            self.src = np.concatenate((self.src, *new_src))[order]
            self.age = np.concatenate((self.age, np.zeros(sum(len(x) for x in new_ids), dtype=np.int64)))[order]

    def remove(self, emitted: np.ndarray) -> None:
        keep = np.ones(self.ids.size, dtype=bool)
        keep[emitted] = False
        self.ids, self.src, self.age = self.ids[keep], self.src[keep], self.age[keep] + 1


def global_schedule(lengths: np.ndarray, *, world_size: int, grouping: GroupingConfig,
                    alignment: AlignmentConfig = AlignmentConfig(), time_cost: TimeCost | None = None,
                    seed: int = 0, extra: Mapping[str, np.ndarray] | None = None, ranks_per_node: int | None = None,
                    keep_home_tolerance: float | None = None, mix: str = "stratified",
                    mix_tolerance: float = GlobalPlanConfig.mix_tolerance, grad_accum_steps: int = 1,
                    name: str = "evenflow_global") -> Schedule:
    """One epoch of global planning over ``lengths`` (sample i has ``lengths[i]`` tokens). Join mode.

    ``mix="cost_order"`` plans cost-ordered, the older planner
    ([`GlobalPlanConfig`][evenflow.planning.GlobalPlanConfig]), for comparison. ``time_cost``: the loader's
    ``time_cost=`` (``None``: its default for ``grouping.cost``, NOTE [ The default time cost ]); ``TimeCost()`` is the
    plain padded-token cost for either cost. ``grad_accum_steps``: the loader's; it orders each round's steps (NOTE [
    Round order ]), and consecutive ``grad_accum_steps`` loader steps form an optimizer step (``step_composition(...,
    grad_accum_steps=)``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    config = GlobalPlanConfig(grouping=grouping, max_steps=alignment.max_steps_per_round,
                              max_wait_rounds=alignment.max_wait_rounds,
                              time_cost=time_cost or default_time_cost(grouping.cost),
                              ranks_per_node=ranks_per_node, keep_home_tolerance=keep_home_tolerance, mix=mix,
                              mix_tolerance=mix_tolerance, grad_accum_steps=grad_accum_steps)
    extra = {k: np.asarray(v, dtype=np.int64) for k, v in (extra or {}).items()}
    buffers = _Buffers(shard(len(lengths), world_size, seed=seed), lengths, alignment, grouping.token_budget)
    steps: list[list[list[int]]] = []
    rounds = moved = moved_tokens = 0
    round_steps: list[int] = []
    progress = EpochProgress()
    while True:
        buffers.fill(rounds)
        if buffers.ids.size == 0 and buffers.exhausted:
            break
        plan = plan_global_round(lengths[buffers.ids], buffers.src, world_size, config=config, age=buffers.age,
                                 extra={k: v[buffers.ids] for k, v in extra.items()}, final=buffers.exhausted,
                                 progress=progress)
        emitted = plan.emitted
        progress = progress.advance(lengths[buffers.ids], emitted)
        away = emitted[plan.dest[emitted] != buffers.src[emitted]]
        moved += int(away.size)
        moved_tokens += int(lengths[buffers.ids[away]].sum())
        steps.extend([[buffers.ids[g].tolist() for g in step] for step in plan.slots()])
        round_steps.append(plan.num_steps)
        buffers.remove(emitted)
        rounds += 1
    return Schedule.from_steps(steps, world_size, layout=grouping.cost, name=name,
                               info={"rounds": rounds, "round_steps": round_steps, "moved": moved,
                                     "moved_tokens": moved_tokens,
                                     "idle_slots": sum(1 for s in steps for g in s if not g)})
