"""``VLMConfig``: how a stock VLM's step is balanced (frozen, keyword-only, checked on construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..balance.costs import QuadraticCost
from ..balance.phases.meta import METADATA_WORDS
from ..balance.planners import BalanceConfig
from ..planning.timecost import TimeCost

__all__ = ["VLMConfig", "BalanceMode", "GradientSync"]

BalanceMode = Literal["full", "llm", "none"]
GradientSync = Literal["detect", "external", "unchecked"]


@dataclass(frozen=True, kw_only=True)
class VLMConfig:
    """Per-phase balancing of one stock VLM step. Must be equal on every rank (it shapes the plan)."""

    layout: Literal["packed", "padded"] = "packed"
    """The LLM phase's batch: ``"packed"`` (padding-free: one row, positions ``[4, 1, N]``, no attention mask)
    or ``"padded"`` (right-padded rows with ``attention_mask``). Both are exact against the stock forward."""
    balance: BalanceMode = "full"
    """``"full"``: every phase balanced on its own (encoder items to encoder ranks, examples to LLM ranks);
    ``"llm"``: only the LLM phase (encoder items are encoded where they were loaded); ``"none"``: nothing moves
    (the same code path: the baseline)."""
    encoder_cost: QuadraticCost | None = None
    """Cost of one frame (or image) of ``L`` patch rows in the encoder; ``None``:
    [`transformer_cost()`][evenflow.vlm.base.transformer_cost] of the vision width. A video costs its frames' sum."""
    llm_cost: QuadraticCost | None = None
    """Cost of one example of ``L`` tokens in the LLM; ``None``: ``transformer_cost`` of the text width."""
    max_encoder_rows: int | None = None
    """No rank encodes more vision patch rows (before merging) than this in one step: the loader's
    ``max_encoder_rows``, the same number, so balancing never piles more on a rank than its budget. A step
    refuses a loader with another one before anything moves."""
    video_slice: int | None = None
    """Split a video into items of at most this many temporal patches (frames / ``temporal_patch_size``), so
    one long video can be encoded on several ranks (its frames are encoded independently, so the outputs are
    the same). ``None``: a video is one item. (Qwen3-VL writes each temporal patch as its own placeholder run:
    its videos are always items of one temporal patch.)"""
    audio_slice: int | None = None
    """Split an audio clip into items of at most this many attention windows of the audio tower (Qwen2.5-Omni:
    ``2 * n_window`` mel frames each), so one long clip can be encoded on several ranks: the tower attends
    within windows and pools pairs inside them, so cutting at window boundaries gives the same outputs
    (NOTE [ Exact audio cuts ] in ``qwen_omni.py``). ``None``: a clip is one item."""
    time_cost: TimeCost | None = None
    """Per-phase costs as the planners' cost object -- the same [`TimeCost`][evenflow.planning.TimeCost] the loader
    takes as ``time_cost=`` -- e.g. a warm-up fit ([`fit_phase_costs()`][evenflow.vlm.fit_phase_costs]): its phase
    on ``"num_patches"`` costs one vision frame of ``L`` patch rows, on ``"num_frames"`` one audio window of
    ``L`` mel frames, on ``"tokens"`` one LLM example of ``L`` tokens. Overrides ``encoder_cost`` and
    ``llm_cost`` (give one or the other). Every rank must plan with the same one (NOTE [ The plan key ])."""
    balance_config: BalanceConfig = BalanceConfig()
    """The planner of every phase (method, locality tolerance)."""
    ranks_per_node: int | None = None
    """Ranks per node, for node-aware placement (``None``: one node)."""
    metadata_words: int = METADATA_WORDS
    """Width of the one metadata all_gather per step (NOTE [ One metadata exchange ])."""
    prefetch: bool = False
    """``True``: each step's metadata exchange and plan are made on the loader's collation thread while the
    previous step trains (register the step with ``BalancedVLM.prefetch_from``); the same plans, losses and
    gradients as ``False``, which makes them inside the step (NOTE [ The plan made in the background ])."""
    gradient_sync: GradientSync = "detect"
    """Who averages the gradients over ranks (NOTE [ Replicas cannot drift silently ] in ``checks.py``):
    ``"detect"``: the model shows it (DDP, FSDP2), else it is refused on more than one rank; ``"external"``:
    something evenflow cannot see does (DeepSpeed, your own all-reduce, a trainer that wraps the model later);
    either way the replicas' parameter checksums are compared once, at the third step. ``"unchecked"``: no
    check at all (parameters sharded by something evenflow cannot see, e.g. DeepSpeed ZeRO-3)."""

    def __post_init__(self) -> None:
        if self.layout not in ("packed", "padded"):
            raise ValueError(f"layout must be 'packed' or 'padded', got {self.layout!r}")
        if self.gradient_sync not in ("detect", "external", "unchecked"):
            raise ValueError(f"gradient_sync must be 'detect', 'external' or 'unchecked', got {self.gradient_sync!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {self.prefetch!r}")
        if self.balance not in ("full", "llm", "none"):
            raise ValueError(f"balance must be 'full', 'llm' or 'none', got {self.balance!r}")
        for name in ("max_encoder_rows", "video_slice", "audio_slice"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.balance_config, BalanceConfig):
            raise ValueError(f"balance_config must be a BalanceConfig, got {type(self.balance_config).__name__}")
        for name in ("encoder_cost", "llm_cost"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, QuadraticCost):
                raise ValueError(f"{name} must be a QuadraticCost or None, got {type(value).__name__}")
        if self.time_cost is not None:
            if not isinstance(self.time_cost, TimeCost):
                raise ValueError(f"time_cost must be an evenflow.planning.TimeCost or None, got "
                                 f"{type(self.time_cost).__name__}")
            if self.encoder_cost is not None or self.llm_cost is not None:
                raise ValueError("give per-phase costs either as time_cost (the planners' TimeCost) or as "
                                 "encoder_cost / llm_cost, not both")
            if self.time_cost.layout != "summed":
                raise ValueError(f"time_cost.layout is {self.time_cost.layout!r}; the orchestrator's phases are "
                                 "packed per item, so their costs add up: use layout='summed'")
