"""Cluster simulator: run the package's own planners for W ranks and price every step with a cost model.

- costs.py      -- per-phase cost model (gamma + alpha L + beta L^2), padded or varlen layout
- schedule.py   -- a schedule: (step, rank, sample) rows, the common currency of every policy
- simulate.py   -- schedule + cost model -> step times, imbalance, padded efficiency
- policies.py   -- evenflow's schedules from the real planners (run_epoch, rebalance_step), the sharding
- calibrate.py  -- fit coefficients from timings (tiny CPU model) or derive them from GPU FLOP rates
- global_policy.py -- global planning: every round one plan over the union of all ranks' buffers
- timefit.py    -- the planner's time cost, fitted on its own calibration split (never the scorer's numbers)
- datasets.py   -- real lengths (chitchat through the Qwen3 template) and paper-matched distributions
- exchange_cost.py -- what a balanced step's exchanges cost: bytes by link, time left on the critical path
- composition.py -- what the steps are made of: length mix (H, H_g) and order (late, q_cv) against random batches
"""

from .composition import step_composition
from .costs import CostModel, Layout, PhaseCost, rank_costs
from .global_policy import global_schedule
from .policies import balanced_schedule, evenflow_schedule, shard
from .schedule import Schedule
from .simulate import SimResult, as_lengths, simulate
from .timefit import fit_time_cost

__all__ = [
    "CostModel", "Layout", "PhaseCost", "rank_costs", "Schedule", "SimResult", "as_lengths", "simulate",
    "evenflow_schedule", "balanced_schedule", "shard", "global_schedule", "fit_time_cost", "step_composition",
]
