"""evenflow: online dynamic batching and cross-rank post-balancing for LLM/MLLM training.

Names are imported on first use (PEP 562), so ``evenflow --help`` / ``--version`` start without importing torch;
``import evenflow`` then ``evenflow.DynamicBatchLoader`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> submodule that defines it
_EXPORTS = {
    **dict.fromkeys(["AlignmentConfig", "GroupingConfig", "LossTokenRule", "count_loss_tokens", "decide_round",
                     "loss_scale", "plan_groups"], ".planning"),
    **dict.fromkeys(["BalanceConfig", "Topology", "plan_balance", "rebalance_step"], ".balance"),
    **dict.fromkeys(["DynamicBatchLoader", "FlatCollate", "LoaderConfig", "PadCollate", "shard_batch",
                     "unshard_batch", "dataset_lengths"], ".runtime"),
    **dict.fromkeys(["ShardLayout"], ".planning.shard"),
    **dict.fromkeys(["STEP_INFO_KEY", "StepInfo", "pop_step_info", "scale_loss"], ".step_info"),
    **dict.fromkeys(["PeerStopped", "PeerError", "StepInfoMisuse", "ExampleError"], ".errors"),
    **dict.fromkeys(["TokenLRRule", "TokenLRScaler", "default_reference_tokens", "lr_factor"], ".lr"),
}

__all__ = [
    "AlignmentConfig", "GroupingConfig", "LossTokenRule", "count_loss_tokens", "decide_round", "loss_scale",
    "plan_groups", "DynamicBatchLoader", "FlatCollate", "LoaderConfig", "PadCollate", "STEP_INFO_KEY",
    "StepInfo", "pop_step_info", "scale_loss", "BalanceConfig", "Topology", "plan_balance", "rebalance_step",
    "TokenLRRule", "TokenLRScaler", "default_reference_tokens", "lr_factor", "PeerStopped", "PeerError",
    "StepInfoMisuse", "ExampleError", "shard_batch", "unshard_batch", "ShardLayout", "dataset_lengths",
]

if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from .balance import BalanceConfig, Topology, plan_balance, rebalance_step
    from .lr import TokenLRRule, TokenLRScaler, default_reference_tokens, lr_factor
    from .planning import (AlignmentConfig, GroupingConfig, LossTokenRule, count_loss_tokens, decide_round,
                           loss_scale, plan_groups)
    from .errors import ExampleError, PeerError, PeerStopped, StepInfoMisuse
    from .planning.shard import ShardLayout
    from .runtime import (DynamicBatchLoader, FlatCollate, LoaderConfig, PadCollate, dataset_lengths, shard_batch,
                          unshard_batch)
    from .step_info import STEP_INFO_KEY, StepInfo, pop_step_info, scale_loss


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'evenflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
