"""The orchestrator's tensors and its only ``torch.distributed`` calls: metadata exchange, data moves, encoder
output routing (the design: :mod:`evenflow.balance.orchestrator`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...planning.loss import LossTokenRule, count_loss_tokens
from ..dispatch import all_to_all_rows
from .meta import ExampleMeta, OrchestratorConfig, PhaseSpec, decode_metadata, encode_metadata
from .plan import PhasePlan, StepPlan, plan_step
from .routing import RankRouting, rank_routing

__all__ = ["Encoder", "ExampleInputs", "LLMInputs", "GlobalOrchestrator", "local_step"]

Encoder = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
"""``encoder(rows, item_rows) -> output rows``: ``rows`` packs the items' input rows back to back,
``item_rows[k]`` is item k's row count; item k must yield ``item_rows[k] // downsample`` output rows, computed
from its own rows only."""


@dataclass
class ExampleInputs:
    """One example's tensors: token ids with placeholder tokens, labels, and the media items per phase."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    media: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)
    """Per phase name, the items in placeholder order, each ``[rows, input_dim]``."""

    def meta(self, config: OrchestratorConfig, rule: LossTokenRule = LossTokenRule()) -> ExampleMeta:
        return ExampleMeta(length=int(self.input_ids.numel()),
                           loss_tokens=count_loss_tokens(self.labels.detach().cpu().numpy(), rule),
                           media=tuple(tuple(int(t.shape[0]) for t in self.media.get(p, ())) for p in config.phases))


# -- the runtime ---------------------------------------------------------------------------------------------

@dataclass
class LLMInputs:
    """What the LLM phase of one rank consumes."""

    example_ids: list[int]
    """Global ids (the order of ``input_ids``)."""
    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    media: dict[str, torch.Tensor]
    """Per phase, encoder output rows in (example, item) order -- fills the placeholders in reading order."""
    media_counts: dict[str, list[int]]
    total_loss_tokens: int
    """Global supervised tokens of the step: divide the summed loss by this on every rank."""


def _check_examples(local: Sequence[ExampleInputs], config: OrchestratorConfig) -> None:
    for j, ex in enumerate(local):
        if ex.input_ids.ndim != 1 or ex.labels.shape != ex.input_ids.shape:
            raise ValueError(f"example {j}: input_ids and labels must be 1-D of equal length, got "
                             f"{tuple(ex.input_ids.shape)} and {tuple(ex.labels.shape)}")
        for p in ex.media:
            if p not in config.encoders:
                raise ValueError(f"example {j}: media phase {p!r} is not in the config's encoders "
                                 f"{config.phases}; add a PhaseSpec for it")
        for p in config.phases:
            for k, t in enumerate(ex.media.get(p, ())):
                if t.ndim != 2 or t.shape[1] != config.encoders[p].input_dim:
                    raise ValueError(f"example {j}, {p} item {k}: shape {tuple(t.shape)} is not [rows, "
                                     f"{config.encoders[p].input_dim}] (PhaseSpec.input_dim)")


def _run_encoders(encoders: Mapping[str, Encoder], rows: Mapping[str, torch.Tensor],
                  item_rows: Mapping[str, Sequence[int]], config: OrchestratorConfig) -> dict[str, torch.Tensor]:
    out = {}
    for p in config.phases:
        y = encoders[p](rows[p], list(item_rows[p]))  # runs even with zero rows (NOTE [ Every rank ... ])
        want = sum(item_rows[p]) // config.encoders[p].downsample
        if y.ndim != 2 or y.shape[0] != want:
            raise ValueError(f"encoder {p!r} returned shape {tuple(y.shape)} for {len(item_rows[p])} items; "
                             f"expected [{want}, hidden] (input rows // downsample={config.encoders[p].downsample})")
        out[p] = y
    return out


def local_step(local: Sequence[ExampleInputs], encoders: Mapping[str, Encoder], config: OrchestratorConfig, *,
               total_loss_tokens: int, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> LLMInputs:
    """The same step without any exchange: every phase runs where the data is (the unbalanced baseline)."""
    _check_examples(local, config)
    dtype = dtype or torch.get_default_dtype()
    rows, item_rows = {}, {}
    for p in config.phases:
        items = [t for ex in local for t in ex.media.get(p, ())]
        item_rows[p] = [int(t.shape[0]) for t in items]
        rows[p] = torch.cat([t.to(device=device, dtype=dtype) for t in items]) if items else \
            torch.zeros(0, config.encoders[p].input_dim, dtype=dtype, device=device)
    encoded = _run_encoders(encoders, rows, item_rows, config)
    counts = {p: [sum(int(t.shape[0]) for t in ex.media.get(p, ())) // config.encoders[p].downsample for ex in local]
              for p in config.phases}
    return LLMInputs(example_ids=list(range(len(local))), input_ids=[ex.input_ids.to(device) for ex in local],
                     labels=[ex.labels.to(device) for ex in local], media=encoded, media_counts=counts,
                     total_loss_tokens=total_loss_tokens)


class GlobalOrchestrator:
    """Runs NOTE [ Composed routing ] on one process group. Rank and world size come from ``group``, once.

    Typical loop (``meta`` and ``plan`` for step t+1 can be prepared while step t trains)::

        orch = GlobalOrchestrator(config, group=balance_group)
        meta = orch.gather_metadata([ex.meta(config) for ex in local])
        plan = plan_step(meta, config)            # pure: may run in a thread
        llm_in = orch.step(plan, local, {"vision": model.encode_vision, "audio": model.encode_audio})
        loss = model.lm_loss_sum(llm_in) / llm_in.total_loss_tokens
        loss.backward()                           # the all-to-all backward runs here, on every rank
        # then sum gradients across ranks (DDP averages: scale the loss by the world size)
    """

    def __init__(self, config: OrchestratorConfig, *, group: dist.ProcessGroup) -> None:
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def gather_metadata(self, local: Sequence[ExampleMeta], *, device: torch.device | str = "cpu"
                        ) -> list[list[ExampleMeta]]:
        """Every rank's metadata (two small all_gathers: sizes, then padded int64 rows). Collective."""
        flat = torch.from_numpy(encode_metadata(local, len(self.config.phases))).to(device)
        size = torch.tensor([flat.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        width = max(int(s.item()) for s in sizes)
        padded = torch.zeros(width, dtype=torch.int64, device=device)
        padded[:flat.numel()] = flat
        rows = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(rows, padded, group=self.group)
        return [decode_metadata(r.cpu().numpy(), len(self.config.phases)) for r in rows]

    def plan(self, meta_by_rank: Sequence[Sequence[ExampleMeta]]) -> StepPlan:
        """:func:`plan_step` with this orchestrator's config (pure; no communication)."""
        if len(meta_by_rank) != self.world_size:
            raise ValueError(f"metadata for {len(meta_by_rank)} ranks, the group has {self.world_size}")
        return plan_step(meta_by_rank, self.config)

    def step(self, plan: StepPlan, local: Sequence[ExampleInputs], encoders: Mapping[str, Encoder], *,
             dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> LLMInputs:
        """Move the data of ``plan``, run the encoders, route their outputs. Collective on ``group``.

        Issues, in this order on every rank: one text all-to-all, one input all-to-all per encoder phase, one
        differentiable all-to-all of all encoder outputs.
        """
        config = self.config
        _check_examples(local, config)
        if plan.world != self.world_size or int((plan.source == self.rank).sum()) != len(local):
            raise ValueError(f"the plan has {int((plan.source == self.rank).sum())} examples on rank {self.rank} "
                             f"but {len(local)} were passed; plan and data must come from the same step")
        dtype = dtype or torch.get_default_dtype()
        routing = rank_routing(plan, self.rank)
        # 1. text: [tokens, 2] int64 rows (input_ids, labels), to the LLM rank.
        send = [torch.stack([local[j].input_ids, local[j].labels], dim=1).to(device=device, dtype=torch.int64)
                for j in routing.text_send_positions]
        text = all_to_all_rows(torch.cat(send) if send else torch.zeros(0, 2, dtype=torch.int64, device=device),
                               routing.text_send, routing.text_recv, group=self.group)
        pieces = torch.split(text, routing.llm_lengths) if routing.llm_lengths else []
        # 2. encoder inputs, to the encoder rank of each item.
        rows = {}
        for p in config.phases:
            items = [t for ex in local for t in ex.media.get(p, ())]
            ordered = [items[k].to(device=device, dtype=dtype) for k in routing.in_send_items[p]]
            x = torch.cat(ordered) if ordered else torch.zeros(0, config.encoders[p].input_dim, dtype=dtype,
                                                                  device=device)
            rows[p] = all_to_all_rows(x, routing.in_send[p], routing.in_recv[p], group=self.group)
        # 3. encoders (every rank, every phase), then ONE exchange of all outputs to the LLM ranks.
        encoded = _run_encoders(encoders, rows, routing.enc_item_rows, config)
        widths = {tuple(y.shape[1:]) for y in encoded.values()}
        if len(widths) > 1:
            raise ValueError(f"encoder outputs have different widths {sorted(widths)}; project every phase to the "
                             "LLM hidden size so they share one exchange")
        cat = torch.cat(list(encoded.values())) if encoded else torch.zeros(0, 1, dtype=dtype, device=device)
        send_rows = cat.index_select(0, torch.from_numpy(routing.out_send_index).to(device))
        received = all_to_all_rows(send_rows, routing.out_send, routing.out_recv, group=self.group)
        media = {p: received.index_select(0, torch.from_numpy(routing.media_index[p]).to(device))
                 for p in config.phases}
        return LLMInputs(example_ids=routing.llm_examples.tolist(), input_ids=[t[:, 0] for t in pieces],
                         labels=[t[:, 1] for t in pieces], media=media, media_counts=routing.media_counts,
                         total_loss_tokens=plan.total_loss_tokens)
