"""The extension point: how one family of Hugging Face VLMs is found, encoded, merged and positioned.

A family is one subclass of [`VLMAdapter`][VLMAdapter] with four methods; everything else -- the metadata
exchange, the per-phase plan, the data moves, the failures shared by every rank, the padded or packed LLM
batch, the loss and its scale -- is shared ([`evenflow.vlm.step`][evenflow.vlm.step]):

- [`supports()`][VLMAdapter.supports] -- does this (unwrapped) model belong to the family? Feature detection: the
  attributes and signatures the adapter calls, never a version number.
- [`find_items()`][VLMAdapter.find_items] -- **found and positioned**: one collated batch (``PadCollate`` /
  ``FlatCollate``) back into its examples, each with its media items (input rows and integer metadata such as
  a grid) in placeholder order, checked against the example's placeholders (errors: [`ExampleError`][ExampleError],
  naming the example), and with the per-token fields only its source rank can compute (M-RoPE positions need
  the grids), which travel with the tokens.
- [`encode()`][VLMAdapter.encode] -- **encoded**: one encoder phase on the items this rank was given (any
  example's, any number, zero included: then a dummy item keeps the parameters in the graph).
- [`forward()`][VLMAdapter.forward] -- **merged**: the stock model's LLM forward on this rank's examples in an
  [`LLMBatch`][LLMBatch] layout, with the routed encoder outputs in place of the placeholders; returns logits.

Adding a family (Qwen3-VL, LLaVA-OneVision, an Omni audio tower) is one module with one such class and one
line in ``families.py``; nothing under [`evenflow.balance.phases`][evenflow.balance.phases] or
[`evenflow.exchange`][evenflow.exchange] changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..balance.costs import QuadraticCost
from ..balance.phases import PhaseSpec
from ..errors import ExampleError
from ..exchange import ExampleInputs, LLMInputs
from ..planning.loss import IGNORE_INDEX
from ..planning.timecost import TOKENS, TimeCost

__all__ = ["VLMAdapter", "LLMBatch", "Layout", "llm_batch", "split_examples", "transformer_cost", "ExampleError",
           "PHASE_LENGTH_KEYS", "phase_cost"]

Layout = Literal["packed", "padded"]

PHASE_LENGTH_KEYS = {"vision": "num_patches", "audio": "num_frames", "llm": TOKENS}
"""Phase -> the per-sample length its [`PhaseTime`][evenflow.planning.PhaseTime] is keyed by: the loader's
``extra_budgets`` names (patch rows, mel frames) and its token count, so one [`TimeCost`][evenflow.planning.TimeCost]
serves the loader and the orchestrator."""


def phase_cost(time_cost: TimeCost | None, phase: str, default: QuadraticCost) -> QuadraticCost:
    """``phase``'s cost in ``time_cost`` (by [`PHASE_LENGTH_KEYS`][PHASE_LENGTH_KEYS]), or ``default`` without one."""
    if time_cost is None:
        return default
    key = PHASE_LENGTH_KEYS[phase]
    found = [p for p in time_cost.phases if p.length_key == key]
    if not found:
        raise ValueError(f"time_cost has no phase on {key!r} for the {phase} phase (it has "
                         f"{list(time_cost.length_keys)}); fit every phase of the model (fit_phase_costs) or add "
                         f"PhaseTime(length_key={key!r}, ...)")
    return found[0]


def transformer_cost(hidden: int) -> QuadraticCost:
    """Per-sequence cost of a transformer stack of width ``hidden``, in units of ``4 * hidden`` FLOPs per layer:
    ``6 * hidden * L + L**2`` (linear layers ~ ``24 hidden^2`` per token, attention ~ ``4 hidden L`` per token;
    Megatron/verl's ``24576 L + L^2`` at hidden 4096). Fit your own with
    [`evenflow.balance.fit_quadratic()`][evenflow.balance.fit_quadratic]."""
    return QuadraticCost(alpha=6.0 * hidden, beta=1.0)


@dataclass
class LLMBatch:
    """One rank's LLM examples in one layout, with next-token targets aligned to ``input_ids``.

    ``packed`` (padding-free): every example back to back in one row ``[1, N]``, ``attention_mask=None``;
    ``example_positions`` restart at 0 per example (a model told where each example starts keeps them apart).
    ``padded``: ``[B, L]`` right-padded with ``attention_mask``. Token fields follow the same layout with their
    width last (``[1, N, w]`` / ``[B, L, w]``; padding is 0). A rank with no example gets one dummy token
    (``dummy=True``, no target): the forward still runs, so every parameter joins the backward.
    """

    layout: Layout
    input_ids: torch.Tensor
    targets: torch.Tensor
    """``targets[..., t]`` is the label of token ``t + 1`` of the same example; -100 where there is none."""
    attention_mask: torch.Tensor | None
    example_positions: torch.Tensor
    """``[1, N]`` (packed) or ``[B, L]`` (padded): each token's position inside its own example."""
    fields: dict[str, torch.Tensor]
    lengths: list[int]
    dummy: bool = False


def llm_batch(llm: LLMInputs, layout: Layout, *, field_widths: Mapping[str, int], pad_token_id: int = 0,
              device: torch.device | str = "cpu") -> LLMBatch:
    """Lay out [`LLMInputs`][evenflow.exchange.LLMInputs] for the model.

    Targets shift within each example: lengths 3 and 2, labels ``[a b c] [d e]`` -> packed targets
    ``[b c - e -]`` (``-`` = -100), so the last token of one example never predicts the first of the next.
    """
    if layout not in ("packed", "padded"):
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    ids, labels = list(llm.input_ids), list(llm.labels)
    fields = {name: [t.reshape(t.shape[0], -1) for t in ts] for name, ts in llm.token_fields.items()}
    dummy = not ids
    if dummy:
        ids = [torch.full((1,), pad_token_id, dtype=torch.long, device=device)]
        labels = [torch.full((1,), IGNORE_INDEX, dtype=torch.long, device=device)]
        fields = {name: [torch.zeros(1, width, dtype=torch.long, device=device)]
                  for name, width in field_widths.items()}
    lengths = [int(t.numel()) for t in ids]
    targets = [torch.cat([lab[1:], lab.new_full((1,), IGNORE_INDEX)]) for lab in labels]
    positions = [torch.arange(n, device=t.device) for n, t in zip(lengths, ids)]
    if layout == "packed":
        return LLMBatch(layout, torch.cat(ids)[None], torch.cat(targets)[None], None, torch.cat(positions)[None],
                        {name: torch.cat(ts)[None] for name, ts in fields.items()}, lengths, dummy)
    width = max(lengths)

    def pad(rows: Sequence[torch.Tensor], value: int) -> torch.Tensor:
        out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), value)
        for i, r in enumerate(rows):
            out[i, :r.shape[0]] = r
        return out

    mask = pad([torch.ones(n, dtype=torch.long, device=ids[0].device) for n in lengths], 0)
    return LLMBatch(layout, pad(ids, pad_token_id), pad(targets, IGNORE_INDEX), mask, pad(positions, 0),
                    {name: pad(ts, 0) for name, ts in fields.items()}, lengths, dummy)


def split_examples(batch: Mapping[str, Any], *, samples: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor,
                                                                                         slice, int]]:
    """``(input_ids, labels, token slice, batch row)`` of each example of a collated batch, in sample order.

    ``PadCollate``: one right-padded row per example, lengths from ``attention_mask``. ``FlatCollate``: one
    row, examples start where ``position_ids`` restart at 0; a padding tail (``pad_to_multiple_of``) is one
    more such run, dropped by ``samples`` (the batch's sample count, e.g. ``StepInfo.local_samples``).
    """
    ids, labels = batch["input_ids"], batch.get("labels")
    if ids.ndim != 2:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; expected a collated [batch, tokens] tensor")
    labels = ids if labels is None else labels
    mask = batch.get("attention_mask")
    out = []
    if mask is not None:
        lengths = mask.sum(dim=1).tolist()
        for row, n in enumerate(lengths):
            if not bool(mask[row, :n].all()):
                raise ExampleError("attention_mask is not a right-padded prefix of ones; collate with right "
                                   "padding (PadCollate)", example=row)
            out.append((ids[row, :n], labels[row, :n], slice(0, n), row))
    else:
        positions = batch.get("position_ids")
        if positions is None or ids.shape[0] != 1:
            raise ValueError("a batch without attention_mask must be one packed row with position_ids "
                             "(FlatCollate); got input_ids of shape " + str(tuple(ids.shape)))
        starts = torch.nonzero(positions.reshape(-1) == 0).flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            out.append((ids[0, a:b], labels[0, a:b], slice(a, b), 0))
    if samples is not None:
        if len(out) < samples:
            raise ValueError(f"the batch holds {len(out)} sequences but {samples} samples")
        out = out[:samples]
    return out


class VLMAdapter(ABC):
    """How one family of stock HF VLMs is found, encoded, merged and positioned (the module docstring).

    Subclasses set `phases` (encoder phase -> [`PhaseSpec`][PhaseSpec]) and `token_fields`
    (name -> width) in ``__init__``; one adapter serves one model (the unwrapped one: DDP/FSDP wrappers are handed to
    [`forward()`][forward] only).
    """

    phases: dict[str, PhaseSpec]
    token_fields: dict[str, int]
    hidden_size: int
    """Width of the encoder outputs the LLM consumes (``OrchestratorConfig.output_dim``)."""
    llm_cost: QuadraticCost
    """Cost of one example of ``L`` tokens in the LLM phase."""
    pad_token_id: int = 0

    @classmethod
    @abstractmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        """Whether ``model`` (unwrapped) is of this family and has every API the adapter calls."""

    @abstractmethod
    def find_items(self, batch: Mapping[str, Any], *, samples: int | None = None,
                   sample_ids: Sequence[int] | None = None) -> list[ExampleInputs]:
        """This rank's examples from one collated batch: media items in placeholder order with their
        metadata, and every `token_fields` entry computed from the example's own tokens and items.
        Raises [`ExampleError`][ExampleError] naming the example (and its ``sample_ids`` entry) when its media do not
        match its placeholders or its grid does not match its rows. ``samples``: the batch's sample count
        (drops a packing tail)."""

    @abstractmethod
    def encode(self, phase: str, rows: torch.Tensor, item_rows: Sequence[int], item_meta: torch.Tensor
               ) -> torch.Tensor:
        """Output rows of the given items (``PhaseSpec.out_rows`` each); zero items included."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, llm: LLMInputs, batch: LLMBatch) -> torch.Tensor:
        """Logits ``[..., vocab]`` in ``batch``'s layout from ``model`` (possibly DDP/FSDP-wrapped), with the
        encoder outputs of ``llm.media`` merged into the placeholders. Must pass every phase's received rows
        into the forward, also when there are none (NOTE [ Every rank enters every collective ])."""

    def warmup_item(self, phase: str, rows: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """``(rows, item_rows, item_meta)`` of one synthetic item of about ``rows`` input rows for [`encode()`][encode],
        to time the phase in a cost fit ([`fit_phase_costs()`][evenflow.vlm.fit_phase_costs]). Optional."""
        raise NotImplementedError(f"{type(self).__name__} makes no warm-up items; pass per-phase costs yourself "
                                  "(VLMConfig.time_cost)")

    def unused_parameters(self) -> list[str]:
        """Names of parameters the stock forward never uses (so they never get a gradient, balanced or not):
        a DDP wrapper without ``find_unused_parameters`` cannot train them. Empty by default."""
        return []

