"""Pure planning: what goes into a batch. numpy only; no torch.distributed, no I/O.

- grouping.py  -- split a buffer into groups under token/sample/resource budgets (padded or summed cost)
- alignment.py -- the DGAP round: every rank evaluates the same rule on the same gathered metadata
- loss.py      -- supervised-token counts and loss scales that make DDP + accumulation exact
- simulate.py  -- the protocol for W ranks in one process (model checker, simulator, benchmarks)
- pooled/      -- global planning, one round over the pooled buffers of all ranks: plan.py (the entry point:
                  balanced mixed steps, least movement), groups.py (grouping the union, the drain), mix.py (what
                  each step is made of and which steps a round emits), place.py (groups to ranks, least movement),
                  packs.py (padding-free packs dealt mixed and balanced on time)
- timecost.py  -- the fitted per-item time cost f(L) = gamma + alpha L + beta L^2 planners balance on
- shard.py     -- shard-ready layouts for CP/SP groups: documents padded to 2 x cp, which tokens each rank holds
"""

from .alignment import (AlignmentConfig, Item, RankPlanner, RankReport, RoundDecision, config_fingerprint,
                        decide_round, wait_bound)
from .pooled import EpochProgress, GlobalPlanConfig, GlobalRoundPlan, plan_global_round
from .grouping import GroupingConfig, GroupingResult, group_costs, plan, plan_groups
from .loss import LossTokenRule, count_loss_tokens, loss_scale, step_loss_scales, window_totals
from .simulate import EpochTrace, SampleMeta, make_planners, run_epoch
from .timecost import PhaseTime, TimeCost, default_time_cost

__all__ = [
    "AlignmentConfig", "Item", "RankPlanner", "RankReport", "RoundDecision", "config_fingerprint", "decide_round",
    "wait_bound", "GroupingConfig", "GroupingResult", "group_costs", "plan", "plan_groups", "LossTokenRule",
    "count_loss_tokens", "loss_scale", "step_loss_scales", "window_totals", "EpochTrace", "SampleMeta",
    "make_planners", "run_epoch", "GlobalPlanConfig", "GlobalRoundPlan", "plan_global_round", "EpochProgress",
    "PhaseTime", "TimeCost", "default_time_cost",
]
