"""The communicators of balancing: the only ``torch.distributed`` code outside the loader's own (``runtime/comm.py``).

- dispatch.py     -- samples or rows to their destination ranks in one ``all_to_all_single``; a differentiable
                     exchange of rows whose backward is the inverse exchange
- orchestrator.py -- ``GlobalOrchestrator``: one multi-phase step (vision encoder, audio encoder, LLM), planned by
                     [`evenflow.balance.phases`][evenflow.balance.phases] and moved here
- failures.py     -- how a rank's failure travels in the step's exchanges

The global orchestrator for multi-phase models: a balanced plan per phase.

One step, on every rank of ``group``:

1. ``gather_metadata`` / ``gather_examples`` -- the only exchange planning needs, one fixed-width all_gather
   (NOTE [ One metadata exchange ] in ``orchestrator.py``): per example its LLM length, supervised tokens and, per
   media item, its input rows and its integers (``PhaseSpec.meta_width``: a grid, a kind).
2. ``plan_step`` -- pure: one [`plan_balance()`][evenflow.balance.planners.plan_balance] per phase. Images go to
   balanced *vision* ranks, audio clips to balanced *audio* ranks, examples to balanced *LLM* ranks, each
   phase under its own cost rule (``PhaseSpec.item_cost``), output-length rule (``PhaseSpec.output_rows``)
   and per-rank row cap (``PhaseSpec.max_rows_per_rank``). It needs metadata only, so the plan for step t+1
   can be computed (e.g. in a thread) while step t runs.
3. ``step`` -- the data moves: text to its LLM rank, with the per-token fields computed where the example was
   loaded (``OrchestratorConfig.token_fields``: positions need the grids), each phase's inputs to its encoder
   rank (one ``all_to_all_single`` each), the encoders run, and their outputs go *directly* to the LLM rank of
   their example in ONE differentiable all-to-all for all phases (NOTE [ Composed routing ]). A failure on one
   rank reaches every rank inside these exchanges (NOTE [ Failures inside a step ] in ``failures.py``).

NOTE [ Composed routing ]
    An image of example e lives on rank s, is encoded on rank v = vision_dest(image) and is consumed on rank
    l = llm_dest(e). Sending the encoder output back to s and then on to l would be two exchanges; the plan
    knows l on every rank, so v sends it straight to l: the routing is the composition of the two
    permutations. Example, 2 ranks: rank 0 holds e0 with a large image, rank 1 holds e1 and e2 with long
    texts; the image is encoded on rank 1 (vision balance), e0 is trained on rank 0 and e2 moves to rank 0
    (LLM balance): the image's output goes 1 -> 0 once. The outputs of all phases share one exchange, so the
    backward pass has exactly one collective, issued in the same place on every rank.

NOTE [ Gradients do not depend on the plan ]
    Moving an example between data-parallel ranks changes where its loss is computed, not its value, as long
    as the loss is normalized by the global supervised token count (``plan.total_loss_tokens``) and gradients
    are summed across ranks (NOTE [ Loss scale ] in [`evenflow.planning.loss`][evenflow.planning.loss]). The encoders
    have no cross-item interaction (no batch norm), so each item's output is the same wherever it is encoded; the
    backward of the all-to-all returns each output's gradient to the rank that encoded it.

Every rank runs every encoder every step, with zero rows if it encodes nothing, so DDP/FSDP collectives on
encoder parameters never diverge (and the all-to-all backward, which every rank must enter, is reached).

The pure half -- configuration, metadata, ``plan_step``, ``rank_routing`` -- is
[`evenflow.balance.phases`][evenflow.balance.phases]; stock Hugging Face VLMs on top of both:
[`evenflow.vlm`][evenflow.vlm].
"""

from __future__ import annotations

from .dispatch import AllToAllRows, all_to_all_rows, exchange_packed, exchange_samples, pack_samples
from .orchestrator import Encoder, ExampleInputs, GlobalOrchestrator, LLMInputs, check_examples, local_step

__all__ = ["GlobalOrchestrator", "ExampleInputs", "LLMInputs", "Encoder", "local_step", "check_examples",
           "exchange_samples", "pack_samples", "exchange_packed", "all_to_all_rows", "AllToAllRows"]
