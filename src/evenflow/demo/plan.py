"""Matching the arms before training: a planner-only dry run of evenflow sizes the fixed arms' accumulation.

The comparison is at matched optimization: every arm takes (about) the same number of optimizer steps over the
same samples. evenflow's step count is not known from the data alone -- it is what the alignment protocol does
with the realized lengths -- so the demo runs the protocol's real planners on the lengths first
(:func:`evenflow.sim.evenflow_schedule`, no model, a fraction of a second) and sizes the fixed arms from it:

    evenflow: 1,000 samples in 119 optimizer steps  -> 8.4 samples per step (both ranks)
    fixed:    batch 1 per rank x 2 ranks             -> accumulation round(8.4 / 2) = 4 -> 125 optimizer steps
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..planning import AlignmentConfig, GroupingConfig
from ..sim import evenflow_schedule
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

    def as_dict(self) -> dict:
        return asdict(self)


def match_arms(config: DemoConfig, lengths: np.ndarray, loss_tokens: np.ndarray) -> Matching:
    """Dry-run the planners on the realized lengths (the loader's defaults, seed and shard) and match."""
    lengths = np.asarray(lengths, dtype=np.int64)
    alignment = AlignmentConfig(buffer_size=config.buffer_size)  # as the evenflow arms' loader; 8 steps per round

    def steps(cost: str) -> int:
        grouping = GroupingConfig(token_budget=config.token_budget, cost=cost)
        return evenflow_schedule(lengths, world_size=config.world_size, grouping=grouping, alignment=alignment,
                                 seed=config.seed).num_steps

    evenflow_steps = steps("padded")
    batch = max(1, config.token_budget // int(lengths.max()))
    per_step = len(lengths) / evenflow_steps
    accumulation = max(1, round(per_step / (batch * config.world_size)))
    micro = -(-(-(-len(lengths) // config.world_size)) // batch)  # DistributedSampler pads shards to equal size
    reference = config.reference_tokens or max(1, round(int(loss_tokens.sum()) / evenflow_steps))
    return Matching(fixed_batch_size=batch, accumulation=accumulation, evenflow_steps=evenflow_steps,
                    summed_steps=steps("summed"), evenflow_samples_per_step=per_step,
                    fixed_steps=-(-micro // accumulation), reference_tokens=reference)
