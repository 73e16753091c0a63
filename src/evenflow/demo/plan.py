"""The dry run before training: every arm's optimizer steps from the realized lengths, no model.

evenflow's step count is not known from the data alone -- it is what the loader's planner does with the realized
lengths -- so the demo runs the real planners of the policy the loader's defaults resolve to (global planning at 2
ranks: [`evenflow.sim.global_schedule()`][evenflow.sim.global_schedule], which equals the loader step for step; a
fraction of a second) and sizes the HF arms from it ([`evenflow.demo.steps`][evenflow.demo.steps]):

    evenflow:   1,000 chats in 117 optimizer steps (8.5 chats a step, both ranks)
    HF default: batch 1 per rank (a batch of 2 would pad past 4,096 tokens somewhere in the epoch), the epoch
                cut into the same 117 steps: 4 or 5 micro-batches per rank (HF's integer accumulation 4: 125)
    TRL:        pack_dataset's best-fit-decreasing rows of 4,096 tokens, one per rank: 97 steps

The HF and TRL arms then train exactly these plans; the evenflow arms run ``DynamicBatchLoader``, whose steps the
same planners predict (``optimizer_steps == planned`` is checked by the tests). Each arm's composition
([`evenflow.sim.step_composition()`][evenflow.sim.step_composition]) goes to the JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..planning import AlignmentConfig, GroupingConfig
from ..runtime.planning import resolve_planning
from ..sim import Schedule, evenflow_schedule, global_schedule, step_composition
from . import steps as arm_steps
from .config import DemoConfig

__all__ = ["ArmPlan", "Matching", "match_arms"]


@dataclass(frozen=True)
class ArmPlan:
    """One arm's epoch as planned before training."""

    optimizer_steps: int
    layout: str
    """``"padded"`` rows or one ``"summed"`` packed row per micro-batch."""
    micro_batches_per_step: float
    """Mean micro-batches per rank and optimizer step (HF's accumulation; 1 for the others)."""
    micro_batches_range: tuple[int, int]
    """Fewest and most micro-batches of a rank in a step (an IDLE placeholder counts as one)."""
    peak_tokens: int
    """Largest micro-batch in tokens: rows x longest (padded) or the packed row's length."""
    fingerprint: str
    """[`evenflow.demo.steps.schedule_fingerprint()`][evenflow.demo.steps.schedule_fingerprint]: which samples each step
    holds, as the replay stores it."""
    composition: dict
    """H, H_g, late, q_cv, rough, timing of the steps
    ([`evenflow.sim.step_composition()`][evenflow.sim.step_composition], one batch per rank
    and optimizer step)."""
    per_rank: list = field(default_factory=list, repr=False)
    """``per_rank[s][r]`` = rank r's micro-batches (sample-id lists) at step s: what the HF and TRL arms train.
    The evenflow arms' loader plans for itself; for them this is the dry run's prediction."""


@dataclass(frozen=True)
class Matching:
    """What the dry run decided (stated in the report)."""

    batch_size: int
    """HF arms, per rank: the largest batch size whose epoch of random batches never pads past the budget."""
    hf_accumulation: int
    """The integer ``gradient_accumulation_steps`` a user would set for evenflow's samples per step; sizes
    ``group_by_length``'s megabatches (the arms themselves take 4 or 5 to match evenflow's steps exactly)."""
    hf_integer_steps: int
    """Optimizer steps HF's ``Trainer`` would take at ``hf_accumulation`` (``DistributedSampler`` pads the shards)."""
    evenflow_steps: int
    reference_tokens: int
    """Reference of the LR rule: mean global supervised tokens per evenflow optimizer step, or
    ``DemoConfig.reference_tokens``."""
    planning: str
    """The policy the evenflow arms' loader runs with its defaults (``planning="auto"`` resolved)."""
    arms: dict[str, ArmPlan]

    def as_dict(self) -> dict:
        out = asdict(self)
        for plan in out["arms"].values():
            del plan["per_rank"]
        return out


def match_arms(config: DemoConfig, lengths: np.ndarray, loss_tokens: np.ndarray) -> Matching:
    """Dry-run the planners on the realized lengths (the loader's defaults, seed and shard) and plan every arm."""
    lengths = np.asarray(lengths, dtype=np.int64)
    world, seed, budget = config.world_size, config.seed, config.token_budget
    alignment = AlignmentConfig(buffer_size=config.buffer_size) if config.buffer_size else AlignmentConfig()
    policy = resolve_planning("auto", world, balance=False, planning_group=None)

    def evenflow(cost: str) -> Schedule:
        plan = global_schedule if policy == "global" else evenflow_schedule
        return plan(lengths, world_size=world, grouping=GroupingConfig(token_budget=budget, cost=cost),
                    alignment=alignment, seed=seed)

    padded = evenflow("padded")
    num_steps = padded.num_steps
    batch = arm_steps.largest_batch_size(lengths, num_steps, token_budget=budget, world_size=world, seed=seed)
    accumulation = arm_steps.hf_accumulation(len(lengths), num_steps, batch, world)
    builders = {
        "hf_default": lambda: ("padded", arm_steps.deal(
            arm_steps.matched_random_steps(len(lengths), num_steps, seed), batch, world)),
        "group_by_length": lambda: ("padded", arm_steps.deal(
            arm_steps.length_grouped_steps(lengths, num_steps, batch * accumulation, seed), batch, world)),
        "trl_packing": lambda: ("summed", arm_steps.pack_steps(arm_steps.trl_packs(lengths, budget), world, seed)),
        "evenflow": lambda: ("padded", _loader_plan(padded)),
        "evenflow_summed": lambda: ("summed", _loader_plan(evenflow("summed"))),
    }
    arms = {name: _arm_plan(*builders[name](), lengths, world) for name in config.arms}
    reference = config.reference_tokens or max(1, round(int(loss_tokens.sum()) / num_steps))
    per_rank_batches = -(-(-(-len(lengths) // world)) // batch)
    return Matching(batch_size=batch, hf_accumulation=accumulation,
                    hf_integer_steps=-(-per_rank_batches // accumulation), evenflow_steps=num_steps,
                    reference_tokens=reference, planning=policy, arms=arms)


def _loader_plan(schedule: Schedule) -> arm_steps.StepPlan:
    """A loader schedule as a plan: one micro-batch per rank and step (an empty rank is IDLE)."""
    return [[[ids] if ids else [] for ids in step] for step in schedule.batches()]


def _arm_plan(layout: str, plan: arm_steps.StepPlan, lengths: np.ndarray, world: int) -> ArmPlan:
    flat = [[[i for mb in rank for i in mb] for rank in step] for step in plan]
    schedule = Schedule.from_steps(flat, world, layout=layout)
    comp = step_composition(schedule, lengths)
    micro = [max(1, len(rank)) for step in plan for rank in step]  # an empty rank still runs an IDLE batch
    return ArmPlan(optimizer_steps=len(plan), layout=layout, micro_batches_per_step=float(np.mean(micro)),
                   micro_batches_range=(min(micro), max(micro)),
                   peak_tokens=arm_steps.peak_tokens(plan, lengths, layout),
                   fingerprint=arm_steps.schedule_fingerprint([[i for rank in step for i in rank] for step in flat]),
                   composition={k: round(float(v), 4) for k, v in comp.items() if k != "S"}, per_rank=plan)
