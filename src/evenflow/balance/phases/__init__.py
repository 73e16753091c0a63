"""The pure half of the multi-phase orchestrator: per-phase configuration, metadata and plans, no tensors moved.

- meta.py    -- ``PhaseSpec`` (one phase: cost rule, output rows, per-rank row cap), ``OrchestratorConfig``,
                ``ExampleMeta`` and its fixed-width int64 encoding (what the one metadata exchange carries)
- plan.py    -- ``plan_step``: one [`plan_balance()`][evenflow.balance.planners.plan_balance] per phase (vision, audio,
  LLM),
                from metadata alone, so the same plan comes out on every rank
- routing.py -- ``rank_routing``: this rank's sends and receives under a ``StepPlan``, encoder outputs routed
                straight to their example's LLM rank (NOTE [ Composed routing ] in
                [`evenflow.exchange`][evenflow.exchange])

[`evenflow.exchange`][evenflow.exchange] runs a plan (the data moves and the encoders); [`evenflow.vlm`][evenflow.vlm]
builds the phases of a
stock Hugging Face VLM.
"""

from .meta import (METADATA_WORDS, ExampleMeta, ItemRule, OrchestratorConfig, PhaseSpec, decode_metadata,
                   encode_metadata)
from .plan import PhaseBalance, PhasePlan, StepPlan, plan_step
from .routing import RankRouting, rank_routing

__all__ = ["PhaseSpec", "OrchestratorConfig", "ExampleMeta", "ItemRule", "METADATA_WORDS", "encode_metadata",
           "decode_metadata", "PhasePlan", "StepPlan", "PhaseBalance", "plan_step", "RankRouting", "rank_routing"]
