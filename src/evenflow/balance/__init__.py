"""Cross-rank post-balancing (OrchMLLM), the planning half: who gets which item, from metadata alone.

- costs.py        -- what an item costs: summed, padded ``n * f(max L)``, ``gamma + alpha L + beta L^2`` (+ fit)
- planners.py     -- who gets which item: ``balance`` (dispatch by method) and ``plan_balance`` = balance +
                     node-aware rank mapping + locality; ``warm_up`` (construction-time first call)
- config.py       -- ``BalanceConfig`` (method, refinement, locality tolerance, assignment)
- basics.py       -- loads, makespan, lower bound, validation, the deterministic item order
- lpt.py / batched.py / kk.py / milp.py -- LPT + swaps, vectorized batched LPT, Karmarkar-Karp, exact MILP
- matching.py     -- sparse greedy bucket -> rank matching on bytes in place (scales to 2,560 ranks)
- padded.py       -- exact min-max split for padded batches (``n * f(max L)``)
- locality.py     -- keep items home when that costs < 2 % balance
- topology.py     -- which rank gets which balanced bucket: exact assignment on bytes, bottleneck-link MILP
- rebalance.py    -- one loader step: move samples between ranks' groups under the padded budget
- phases/         -- multi-phase MLLMs: a plan per phase (meta, plan, routing)

All of it pure: no ``torch.distributed`` here. The data moves -- the all-to-all of samples, the differentiable
all-to-all and the orchestrator that runs a multi-phase plan -- are [`evenflow.exchange`][evenflow.exchange].
"""

from .costs import QuadraticCost, as_costs, fit_quadratic, item_costs, padded_cost, summed_cost
from .locality import locality_plan
from .matching import assign_buckets_greedy
from .padded import padded_loads, padded_partition
from .planners import (BalanceConfig, balance, karmarkar_karp, loads, lower_bound, lpt, lpt_batched, makespan,
                       milp_balance, plan_balance, refine_pairs, refine_swaps, warm_up)
from .rebalance import rebalance_step
from .topology import (Topology, assign_buckets, assign_buckets_milp, link_loads, topology_from_env,
                       transfer_bytes, transfer_matrices, transfer_stats)

__all__ = [
    "QuadraticCost", "as_costs", "fit_quadratic", "item_costs", "padded_cost", "summed_cost",
    "BalanceConfig", "balance", "karmarkar_karp", "loads", "locality_plan", "lower_bound", "lpt", "lpt_batched",
    "makespan", "milp_balance", "padded_loads", "padded_partition", "plan_balance", "refine_pairs", "refine_swaps",
    "rebalance_step", "warm_up", "assign_buckets_greedy",
    "Topology", "assign_buckets", "assign_buckets_milp", "link_loads", "topology_from_env", "transfer_bytes",
    "transfer_matrices", "transfer_stats",
]
