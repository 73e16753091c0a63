"""Which adapter serves a model: the known families, tried in order by feature detection."""

from __future__ import annotations

import torch

from .base import VLMAdapter
from .config import VLMConfig
from .qwen2_vl import QwenVLAdapter
from .qwen3_vl import Qwen3VLAdapter
from .qwen_omni import QwenOmniAdapter

__all__ = ["FAMILIES", "adapter_for", "unwrap_model"]

FAMILIES: tuple[type[VLMAdapter], ...] = (QwenVLAdapter, QwenOmniAdapter, Qwen3VLAdapter)
"""Adapter classes by family; a new family adds its class here (nothing else changes)."""


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under a DDP / DataParallel wrapper (FSDP2's ``fully_shard`` keeps the model itself)."""
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, parallel):
        model = model.module
    return model


def adapter_for(model: torch.nn.Module, config: VLMConfig = VLMConfig()) -> VLMAdapter:
    """The first family whose [`supports()`][VLMAdapter.supports] accepts ``model`` (unwrapped first)."""
    base = unwrap_model(model)
    for family in FAMILIES:
        if family.supports(base):
            return family(base, config)
    kind = getattr(getattr(base, "config", None), "model_type", None)
    raise ValueError(f"no evenflow VLM adapter supports {type(base).__name__} (model_type={kind!r}); known: "
                     f"{[f.__name__ for f in FAMILIES]}. A family is one VLMAdapter subclass "
                     "(evenflow.vlm.base); pass it as adapter=")
