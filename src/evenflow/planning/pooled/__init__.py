"""Global planning (``planning="global"``): one round over the pooled buffers of all ranks. Pure.

- plan.py   -- [`plan_global_round()`][plan_global_round], the entry point every rank evaluates on the same gathered
  metadata
- groups.py -- step 1: groups over the union under the budgets; the drain's re-plan
- mix.py    -- step 2: what each optimizer step is made of and which steps a round emits
- place.py  -- steps 3 and 4: equal-cost steps (``mix="cost_order"``), each group to the rank holding most of
               its bytes
- packs.py  -- padding-free packs (``cost="summed"``) dealt mixed and balanced on time;
               lpt.py, its fallback on best fit's packs
"""

from .mix import EpochProgress
from .plan import GlobalPlanConfig, GlobalRoundPlan, global_groups, plan_global_round, round_target

__all__ = ["EpochProgress", "GlobalPlanConfig", "GlobalRoundPlan", "global_groups", "plan_global_round",
           "round_target"]
