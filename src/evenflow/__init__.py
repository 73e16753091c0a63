"""evenflow: online dynamic batching and cross-rank post-balancing for LLM/MLLM training."""

from .planning import (AlignmentConfig, GroupingConfig, LossTokenRule, count_loss_tokens, decide_round, loss_scale,
                       plan_groups)

__all__ = [
    "AlignmentConfig", "GroupingConfig", "LossTokenRule", "count_loss_tokens", "decide_round", "loss_scale",
    "plan_groups",
]
__version__ = "0.1.0"
