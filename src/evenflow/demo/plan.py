"""Matching the arms before training: a planner-only dry run of evenflow sizes the fixed arms' accumulation.

The comparison is at matched optimization: every arm takes (about) the same number of optimizer steps over the
same samples. evenflow's step count is not known from the data alone -- it is what the loader's planner does
with the realized lengths -- so the demo runs the real planners of the policy the loader's defaults resolve to
(global planning at 2 ranks: :func:`evenflow.sim.global_schedule`, which equals the loader step for step; no
model, a fraction of a second) and sizes the fixed arms from it:

    evenflow: 1,000 samples in 117 optimizer steps  -> 8.5 samples per step (both ranks)
    fixed:    batch 1 per rank x 2 ranks             -> accumulation round(8.5 / 2) = 4 -> 125 optimizer steps

The same dry run gives each arm's step composition (:func:`evenflow.sim.step_composition`: H_g, late), which
the report prints beside the loss: the fixed arms' orders are deterministic too (seeded sampler, HF's grouping).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..planning import AlignmentConfig, GroupingConfig
from ..runtime.planning import resolve_planning
from ..sim import Schedule, evenflow_schedule, global_schedule, step_composition
from .config import DemoConfig

__all__ = ["Matching", "match_arms"]


@dataclass(frozen=True)
class Matching:
    """What the dry run decided, for every arm (and stated in the report)."""

    fixed_batch_size: int
    """Per rank: the largest batch size whose batches of the longest sample fit the token budget."""
    accumulation: int
    """Micro-batches per optimizer step of the fixed arms, matched to evenflow's samples per step."""
    evenflow_steps: int
    """Optimizer steps of the evenflow epoch (padded cost), from the dry run."""
    summed_steps: int
    """The same for the summed (padding-free) cost."""
    evenflow_samples_per_step: float
    """Global samples per evenflow optimizer step (both ranks)."""
    fixed_steps: int
    """Optimizer steps of a fixed epoch at ``accumulation`` (the last window may be shorter)."""
    reference_tokens: int
    """Reference of the LR rule for every arm: mean global supervised tokens per evenflow optimizer step, or
    ``DemoConfig.reference_tokens``."""
    planning: str = "global"
    """The policy the evenflow arms' loader runs with its defaults (``planning="auto"`` resolved)."""
    composition: dict = field(default_factory=dict)
    """Per arm: H, H_g, late and q_cv of its planned optimizer steps (:func:`evenflow.sim.step_composition`)."""

    def as_dict(self) -> dict:
        return asdict(self)


def match_arms(config: DemoConfig, lengths: np.ndarray, loss_tokens: np.ndarray) -> Matching:
    """Dry-run the planners on the realized lengths (the loader's defaults, seed and shard) and match."""
    lengths = np.asarray(lengths, dtype=np.int64)
    alignment = AlignmentConfig(buffer_size=config.buffer_size) if config.buffer_size else AlignmentConfig()
    policy = resolve_planning("auto", config.world_size, balance=False, planning_group=None)

    def schedule(cost: str) -> Schedule:
        grouping = GroupingConfig(token_budget=config.token_budget, cost=cost)
        plan = global_schedule if policy == "global" else evenflow_schedule
        return plan(lengths, world_size=config.world_size, grouping=grouping, alignment=alignment, seed=config.seed)

    padded, summed = schedule("padded"), schedule("summed")
    evenflow_steps = padded.num_steps
    batch = max(1, config.token_budget // int(lengths.max()))
    per_step = len(lengths) / evenflow_steps
    accumulation = max(1, round(per_step / (batch * config.world_size)))
    micro = -(-(-(-len(lengths) // config.world_size)) // batch)  # DistributedSampler pads shards to equal size
    reference = config.reference_tokens or max(1, round(int(loss_tokens.sum()) / evenflow_steps))

    def mix(s: Schedule, accumulate: int = 1) -> dict:
        return {k: round(float(v), 3) for k, v in step_composition(s, lengths, grad_accum_steps=accumulate).items()
                if k != "S"}

    composition = {"evenflow": mix(padded), "evenflow_sqrt_lr": mix(padded), "evenflow_summed": mix(summed),
                   "fixed": mix(fixed_schedule(len(lengths), config, batch), accumulation),
                   "group_by_length": mix(grouped_schedule(lengths, config, batch, accumulation), accumulation)}
    return Matching(fixed_batch_size=batch, accumulation=accumulation, evenflow_steps=evenflow_steps,
                    summed_steps=summed.num_steps, evenflow_samples_per_step=per_step,
                    fixed_steps=-(-micro // accumulation), reference_tokens=reference, planning=policy,
                    composition=composition)


def fixed_schedule(n: int, config: DemoConfig, batch: int) -> Schedule:
    """The ``fixed`` arm's micro-batches: each rank's seeded ``DistributedSampler`` order, ``batch`` at a time
    (loader step k = every rank's k-th micro-batch; ``grad_accum_steps`` groups them into optimizer steps)."""
    from torch.utils.data import DistributedSampler

    per_rank = [list(DistributedSampler(range(n), num_replicas=config.world_size, rank=r, shuffle=True,
                                        seed=config.seed, drop_last=False)) for r in range(config.world_size)]
    return Schedule.from_rank_batches([[ids[k:k + batch] for k in range(0, len(ids), batch)] for ids in per_rank])


def grouped_schedule(lengths: np.ndarray, config: DemoConfig, batch: int, accumulation: int) -> Schedule:
    """The ``group_by_length`` arm's micro-batches: HF's length-grouped order dealt round-robin to ranks (as
    ``evenflow.demo.arms`` feeds them)."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    order = get_length_grouped_indices(lengths.tolist(), batch * accumulation,
                                       generator=torch.Generator().manual_seed(config.seed))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    per_rank = -(-len(batches) // config.world_size)
    batches = batches + batches[:per_rank * config.world_size - len(batches)]
    return Schedule.from_rank_batches([batches[r::config.world_size] for r in range(config.world_size)])
