"""evenflow: online dynamic batching and cross-rank post-balancing for LLM/MLLM training."""

from .planning import (AlignmentConfig, GroupingConfig, LossTokenRule, count_loss_tokens, decide_round, loss_scale,
                       plan_groups)
from .balance import BalanceConfig, Topology, plan_balance, rebalance_step
from .runtime import (STEP_INFO_KEY, DynamicBatchLoader, FlatCollate, LoaderConfig, PadCollate, StepInfo,
                      pop_step_info, scale_loss)

__all__ = [
    "AlignmentConfig", "GroupingConfig", "LossTokenRule", "count_loss_tokens", "decide_round", "loss_scale",
    "plan_groups", "DynamicBatchLoader", "FlatCollate", "LoaderConfig", "PadCollate", "STEP_INFO_KEY",
    "StepInfo", "pop_step_info", "scale_loss", "BalanceConfig", "Topology", "plan_balance", "rebalance_step",
]
__version__ = "0.1.0"
