"""Causal attention that stops at packed-sequence boundaries without a dense mask: varlen attention on CPU.

NOTE [ Packed attention on CPU ]
    A padding-free pack is one row of several sequences whose ``position_ids`` restart at 0. Stock HF ``sdpa``
    turns the restarts into a dense ``[T, T]`` block-diagonal mask, which costs ``T**2`` per head and layer and
    leaves SDPA's fused causal kernel: a 4,096-token row of ten chats (96 to 900 tokens) took 4.7-6.3 s forward
    and backward on one core of the loaded 2-core machine, against 1.5-2.2 s for the same chats one by one and
    1.5-2.7 s with this function (4 repeats each, the demo's model). On a GPU, packing runs flash-attention's
    varlen kernel instead, whose cost is the sum of each sequence's own square. This function is that kernel's
    CPU equivalent: one fused causal SDPA call per sequence, on slices of the row, so the packed arms (TRL's
    packing, ``cost="summed"``) are timed as a GPU user would run them. The math is the block-diagonal causal
    attention either way.

    For [0, 1, 2, 0, 1] the sequences are rows [0, 3) and [3, 5). A row with no restart after its start -- every
    padded batch -- is one causal SDPA call, as stock ``sdpa`` makes without a mask.

Every arm of the demo runs it (the ranks build their models with ``attn_implementation=ATTENTION``), registered
through transformers' public ``AttentionInterface``. No mask function is registered for the name, so the model
builds no mask at all (masks are for padding the loss ignores: NOTE in
[`evenflow.demo.train.sum_loss()`][evenflow.demo.train.sum_loss]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "register", "segment_causal_attention"]

ATTENTION = "evenflow_demo_segments"
"""The name under which [`register()`][register] adds [`segment_causal_attention()`][segment_causal_attention] to
transformers."""


def segment_bounds(position_ids: torch.Tensor | None, length: int) -> list[int]:
    """Start of each sequence of a one-row batch, and its end: ``[0, 3, 5]`` for positions [0, 1, 2, 0, 1].

    >>> segment_bounds(torch.tensor([[0, 1, 2, 0, 1]]), 5)
    [0, 3, 5]
    >>> segment_bounds(None, 4)
    [0, 4]
    """
    if position_ids is None or position_ids.shape[0] != 1:
        return [0, length]
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    return sorted({0, *starts, length})


def segment_causal_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, T, D]``
    -> ``[B, T, H, D]``. ``attention_mask`` is ``None`` (no mask function is registered for
    [`ATTENTION`][ATTENTION])."""
    if attention_mask is not None or dropout:
        raise ValueError("segment_causal_attention takes no mask and no dropout: the demo pads on the right and "
                         "never attends to a pad (NOTE [ Packed attention on CPU ])")
    bounds = segment_bounds(position_ids, query.shape[2])
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                            scale=scaling, enable_gqa=True) for a, b in zip(bounds[:-1], bounds[1:])]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Add [`segment_causal_attention()`][segment_causal_attention] to transformers' ``AttentionInterface``
    (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, segment_causal_attention)
    return ATTENTION
