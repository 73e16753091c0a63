"""The orchestrator's tensors and its only ``torch.distributed`` calls: metadata exchange, data moves, encoder
output routing (the design: [`evenflow.exchange`][evenflow.exchange]).

NOTE [ One metadata exchange ]
    Planning needs every rank's metadata. Each rank puts a status word, its payload length, its plan key
    (NOTE [ The plan key ] in ``meta.py``), the caller's ``STAMP_WORDS`` stamp words (what the ranks must agree
    on beyond the plan: the balanced VLM step's loader step and a parameter checksum) and the first
    ``metadata_words - 6`` words of its metadata
    ([`encode_metadata()`][encode_metadata]) into one fixed-width all_gather; the lengths tell every rank at once
    whether anyone overflowed, and only then a second all_gather carries the rest (padded to the longest overflow), on
    every rank. So a step costs one metadata collective unless a rank holds more than ``metadata_words`` words
    (~40 examples with one image at the default), a failed rank's report rides the same exchange (NOTE
    [ Failures inside a step ] in ``failures.py``), and so does the check that every rank plans alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..balance.phases.meta import ExampleMeta, OrchestratorConfig, decode_metadata, encode_metadata
from ..balance.phases.plan import StepPlan, plan_step
from ..balance.phases.routing import RankRouting, rank_routing
from ..errors import DETAIL_WIDTH, PeerError
from ..planning.loss import LossTokenRule, count_loss_tokens
from .dispatch import all_to_all_rows
from .failures import STATUS_FAILED, detail_row, header_rows, raise_shared, read_header

__all__ = ["Encoder", "ExampleInputs", "LLMInputs", "GlobalOrchestrator", "local_step", "check_examples",
           "STAMP_WORDS"]

STAMP_WORDS = 3
"""Caller words on each rank's exchange row (``gather_examples(stamp=)``), gathered as
[`GlobalOrchestrator.stamps`][GlobalOrchestrator.stamps] for the caller to compare (0 where not given)."""
_HEADER_WORDS = 3 + STAMP_WORDS
"""Words before a rank's metadata in its exchange row: status, payload length, plan key, the stamp."""

SendBuffers = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A step's first sends: ``[rows, text_columns]`` int64 text rows and, per encoder phase, its input rows."""
Encoder = Callable[..., torch.Tensor]
"""``encoder(rows, item_rows) -> output rows``; for a phase with ``meta_width > 0``,
``encoder(rows, item_rows, item_meta)`` with ``item_meta`` int64 ``[items, meta_width]``. ``rows`` packs the
items' input rows back to back, ``item_rows[k]`` is item k's row count; item k must yield its output rows
(``PhaseSpec.out_rows``) computed from its own rows only. Called on every rank in every step, also with zero
items."""


@dataclass
class ExampleInputs:
    """One example's tensors: token ids with placeholder tokens, labels, and the media items per phase."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    media: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)
    """Per phase name, the items in placeholder order, each ``[rows, input_dim]``."""
    media_meta: Mapping[str, Sequence[Sequence[int]]] = field(default_factory=dict)
    """Per phase with ``meta_width > 0``, each item's integers (e.g. ``(kind, t, h, w)``), in item order."""
    token_fields: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per ``OrchestratorConfig.token_fields`` name, an integer tensor ``[length]`` (width 1) or ``[length,
    width]``, moved with the tokens (positions computed where the grids are)."""

    def meta(self, config: OrchestratorConfig, rule: LossTokenRule = LossTokenRule()) -> ExampleMeta:
        media_meta = tuple(tuple(tuple(int(v) for v in m) for m in self.media_meta.get(p, ()))
                           if spec.meta_width else tuple(() for _ in self.media.get(p, ()))
                           for p, spec in config.encoders.items())
        return ExampleMeta(length=int(self.input_ids.numel()),
                           loss_tokens=count_loss_tokens(self.labels.detach().cpu().numpy(), rule),
                           media=tuple(tuple(int(t.shape[0]) for t in self.media.get(p, ())) for p in config.phases),
                           media_meta=media_meta if any(config.meta_widths) else ())


def check_examples(local: Sequence[ExampleInputs], config: OrchestratorConfig) -> None:
    """Every example's shapes against the config; the error names the example, the item and the setting."""
    for j, ex in enumerate(local):
        if ex.input_ids.ndim != 1 or ex.labels.shape != ex.input_ids.shape:
            raise ValueError(f"example {j}: input_ids and labels must be 1-D of equal length, got "
                             f"{tuple(ex.input_ids.shape)} and {tuple(ex.labels.shape)}")
        for p in ex.media:
            if p not in config.encoders:
                raise ValueError(f"example {j}: media phase {p!r} is not in the config's encoders "
                                 f"{config.phases}; add a PhaseSpec for it")
        for p, spec in config.encoders.items():
            items = ex.media.get(p, ())
            for k, t in enumerate(items):
                if t.ndim != 2 or t.shape[1] != spec.input_dim:
                    raise ValueError(f"example {j}, {p} item {k}: shape {tuple(t.shape)} is not [rows, "
                                     f"{spec.input_dim}] (PhaseSpec.input_dim)")
            metas = ex.media_meta.get(p, ())
            if spec.meta_width and (len(metas) != len(items) or any(len(m) != spec.meta_width for m in metas)):
                raise ValueError(f"example {j}, {p}: {len(items)} items need {len(items)} metadata tuples of "
                                 f"{spec.meta_width} integers (PhaseSpec.meta_width), got {list(metas)}")
        for name, width in config.token_fields.items():
            t = ex.token_fields.get(name)
            want = (ex.input_ids.numel(),) if width == 1 else (ex.input_ids.numel(), width)
            if t is None or tuple(t.shape) != want or t.is_floating_point() or t.is_complex():
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"example {j}: token field {name!r} must be an integer tensor of shape {want} "
                                 f"(OrchestratorConfig.token_fields), got {got}")
        extra = set(ex.token_fields) - set(config.token_fields)
        if extra:
            raise ValueError(f"example {j}: token fields {sorted(extra)} are not in OrchestratorConfig.token_fields "
                             f"{sorted(config.token_fields)}; declare them so every rank moves them")


def _text_rows(ex: ExampleInputs, config: OrchestratorConfig, device: torch.device | str) -> torch.Tensor:
    """``[length, text_columns]`` int64: input_ids, labels, then every token field (config order)."""
    cols = [ex.input_ids.reshape(-1, 1), ex.labels.reshape(-1, 1)]
    cols += [ex.token_fields[name].reshape(ex.input_ids.numel(), -1) for name in config.token_fields]
    return torch.cat([c.to(device=device, dtype=torch.int64) for c in cols], dim=1)


def _split_text(pieces: Sequence[torch.Tensor], config: OrchestratorConfig) -> dict[str, list[torch.Tensor]]:
    out, col = {}, 2
    for name, width in config.token_fields.items():
        out[name] = [t[:, col] if width == 1 else t[:, col:col + width] for t in pieces]
        col += width
    return out


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
    token_fields: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per token field, one tensor per example (``[length]`` or ``[length, width]``)."""
    media_item_rows: dict[str, list[int]] = field(default_factory=dict)
    """Per phase, output rows of each item in ``media`` order (split ``media`` by it for per-item outputs)."""
    media_item_meta: dict[str, np.ndarray] = field(default_factory=dict)
    """Per phase, ``[items, meta_width]`` metadata of each item in ``media`` order (kinds, grids)."""


def _run_encoders(encoders: Mapping[str, Encoder], rows: Mapping[str, torch.Tensor],
                  item_rows: Mapping[str, Sequence[int]], item_meta: Mapping[str, np.ndarray],
                  out_rows: Mapping[str, int], config: OrchestratorConfig) -> dict[str, torch.Tensor]:
    out = {}
    for p, spec in config.encoders.items():
        if spec.meta_width:  # runs even with zero rows (NOTE [ Every rank enters every collective ])
            meta = torch.as_tensor(np.asarray(item_meta[p], dtype=np.int64).reshape(-1, spec.meta_width))
            y = encoders[p](rows[p], list(item_rows[p]), meta)
        else:
            y = encoders[p](rows[p], list(item_rows[p]))
        want = out_rows[p]
        if y.ndim != 2 or y.shape[0] != want:
            raise ValueError(f"encoder {p!r} returned shape {tuple(y.shape)} for {len(item_rows[p])} items; "
                             f"expected [{want}, hidden] (PhaseSpec.out_rows: input rows // downsample="
                             f"{spec.downsample} unless the phase states output_rows)")
        out[p] = y
    return out


def local_step(local: Sequence[ExampleInputs], encoders: Mapping[str, Encoder], config: OrchestratorConfig, *,
               total_loss_tokens: int, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> LLMInputs:
    """The same step without any exchange: every phase runs where the data is (the unbalanced baseline)."""
    check_examples(local, config)
    dtype = dtype or torch.get_default_dtype()
    rows, item_rows, item_meta, out_rows, out_items = {}, {}, {}, {}, {}
    for p, spec in config.encoders.items():
        items = [t for ex in local for t in ex.media.get(p, ())]
        item_rows[p] = [int(t.shape[0]) for t in items]
        item_meta[p] = np.asarray([m for ex in local for m in ex.media_meta.get(p, ())] if spec.meta_width else [],
                                  dtype=np.int64).reshape(len(items), spec.meta_width)
        out_items[p] = spec.out_rows(np.asarray(item_rows[p], dtype=np.int64), item_meta[p])
        out_rows[p] = int(out_items[p].sum())
        rows[p] = torch.cat([t.to(device=device, dtype=dtype) for t in items]) if items else \
            torch.zeros(0, spec.input_dim, dtype=dtype, device=device)
    encoded = _run_encoders(encoders, rows, item_rows, item_meta, out_rows, config)
    counts, start = {p: [] for p in config.phases}, {p: 0 for p in config.phases}
    for ex in local:
        for p in config.phases:
            k = len(ex.media.get(p, ()))
            counts[p].append(int(out_items[p][start[p]:start[p] + k].sum()))
            start[p] += k
    return LLMInputs(example_ids=list(range(len(local))), input_ids=[ex.input_ids.to(device) for ex in local],
                     labels=[ex.labels.to(device) for ex in local], media=encoded, media_counts=counts,
                     total_loss_tokens=total_loss_tokens,
                     token_fields={name: [ex.token_fields[name].to(device) for ex in local]
                                   for name in config.token_fields},
                     media_item_rows={p: out_items[p].tolist() for p in config.phases},
                     media_item_meta=item_meta)


class GlobalOrchestrator:
    """Runs NOTE [ Composed routing ] on one process group. Rank and world size come from ``group``, once.

    Typical loop (``meta`` and ``plan`` for step t+1 can be prepared while step t trains)::

        orch = GlobalOrchestrator(config, group=balance_group)
        local, meta = orch.gather_examples(lambda: my_examples(batch))   # failures shared (failures.py)
        plan = orch.plan(meta)                    # pure: may run in a thread
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
        self.plan_key = config.plan_key()
        """Checked against every rank's in each metadata exchange (NOTE [ The plan key ])."""
        self.stamps = np.zeros((self.world_size, STAMP_WORDS), dtype=np.int64)
        """Every rank's stamp words of the last metadata exchange (``[world, STAMP_WORDS]``)."""

    # -- metadata --------------------------------------------------------------------------------------------
    def gather_metadata(self, local: Sequence[ExampleMeta], *, failure: BaseException | None = None,
                        device: torch.device | str = "cpu", stamp: Sequence[int] = (),
                        timeout: timedelta | None = None) -> list[list[ExampleMeta]]:
        """Every rank's metadata (NOTE [ One metadata exchange ]). Collective.

        ``failure``: this rank could not build its examples; it is raised here on this rank and as
        [`PeerError`][evenflow.PeerError] on every other (NOTE [ Failures inside a step ]). ``stamp``: up to
        ``STAMP_WORDS`` integers every rank sees in [`stamps`][stamps]. ``timeout``: bound on the wait for the
        first exchange (``TimeoutError`` past it: a rank that did not enter it); ``None``: the group's own.
        """
        config, width = self.config, self.config.metadata_words
        head_words = width - _HEADER_WORDS
        row = np.zeros(width, dtype=np.int64)
        row[2] = self.plan_key
        if len(stamp) > STAMP_WORDS:
            raise ValueError(f"stamp holds {len(stamp)} words, at most {STAMP_WORDS}")
        row[3:3 + len(stamp)] = np.asarray(stamp, dtype=np.int64)
        flat = np.zeros(0, dtype=np.int64)
        if failure is None:
            try:
                flat = encode_metadata(local, len(config.phases), meta_widths=config.meta_widths)
            except Exception as exc:  # noqa: BLE001 - shared below, raised on every rank
                failure = exc
        if failure is not None:
            row[0] = STATUS_FAILED
            row[_HEADER_WORDS:_HEADER_WORDS + DETAIL_WIDTH] = detail_row(failure)
        else:
            row[1] = flat.size
            head = flat[:head_words]
            row[_HEADER_WORDS:_HEADER_WORDS + head.size] = head
        table = self._all_gather(row, device, timeout)
        self.stamps = table[:, 3:_HEADER_WORDS].copy()
        failed = table[:, 0] == STATUS_FAILED
        reports = np.where(failed[:, None], table[:, _HEADER_WORDS:_HEADER_WORDS + DETAIL_WIDTH], 0)
        raise_shared(reports, failure, rank=self.rank, where="while building this step's examples")
        self._check_plan_keys(table[:, 2])
        sizes = table[:, 1]
        overflow = int(sizes.max(initial=0)) - head_words
        rest = np.zeros((self.world_size, 0), dtype=np.int64)
        if overflow > 0:  # a second exchange, entered by every rank (every rank saw the same sizes)
            tail = np.zeros(overflow, dtype=np.int64)
            tail[:max(0, flat.size - head_words)] = flat[head_words:]
            rest = self._all_gather(tail, device)
        return [decode_metadata(np.concatenate([table[r, _HEADER_WORDS:_HEADER_WORDS + min(int(sizes[r]), head_words)],
                                                rest[r, :max(0, int(sizes[r]) - head_words)]]),
                                len(config.phases), meta_widths=config.meta_widths)
                for r in range(self.world_size)]

    def _check_plan_keys(self, keys: np.ndarray) -> None:
        """Raise on every rank when a rank plans with another configuration (NOTE [ The plan key ])."""
        differ = np.flatnonzero(keys != keys[0])
        if differ.size:
            r = int(differ[0])
            raise PeerError(r, "ValueError", f"rank {r} plans with another orchestrator configuration than rank 0 "
                            f"(plan key {int(keys[r]):#x}, rank 0: {int(keys[0]):#x}): its cost models or settings "
                            "differ, so the ranks would compute different plans. Fit the costs once and broadcast "
                            "them (evenflow.vlm.fit_phase_costs), or load the same saved costs on every "
                            "rank (NOTE [ The plan key ])", None, this_rank=self.rank)

    def gather_examples(self, build: Callable[[], Sequence[ExampleInputs]], *, rule: LossTokenRule = LossTokenRule(),
                        device: torch.device | str = "cpu", stamp: Sequence[int] = (),
                        timeout: timedelta | None = None) -> tuple[list[ExampleInputs], list[list[ExampleMeta]]]:
        """``build()`` this rank's examples, check them, and gather everyone's metadata. Collective.

        An exception from ``build`` or from the checks does not leave this rank out of the exchange: it is
        raised on every rank, after it (NOTE [ Failures inside a step ]).
        """
        local: list[ExampleInputs] = []
        failure = None
        try:
            local = list(build())
            check_examples(local, self.config)
            metas = [ex.meta(self.config, rule) for ex in local]
        except Exception as exc:  # noqa: BLE001 - shared in the exchange below
            failure, metas = exc, []
        return local, self.gather_metadata(metas, failure=failure, device=device, stamp=stamp, timeout=timeout)

    def _all_gather(self, row: np.ndarray, device: torch.device | str, timeout: timedelta | None = None
                    ) -> np.ndarray:
        t = torch.from_numpy(row).to(device)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        if timeout is None:
            dist.all_gather(out, t, group=self.group)
        else:
            work = dist.all_gather(out, t, group=self.group, async_op=True)
            try:
                work.wait(timeout)
            except RuntimeError as exc:  # gloo and NCCL report a timed-out wait as a RuntimeError
                raise TimeoutError(f"rank {self.rank}: not every rank of the group entered the metadata exchange "
                                   f"within {timeout.total_seconds():g} s") from exc
        return torch.stack(out).cpu().numpy()

    def plan(self, meta_by_rank: Sequence[Sequence[ExampleMeta]]) -> StepPlan:
        """[`plan_step()`][plan_step] with this orchestrator's config (pure; no communication)."""
        if len(meta_by_rank) != self.world_size:
            raise ValueError(f"metadata for {len(meta_by_rank)} ranks, the group has {self.world_size}")
        return plan_step(meta_by_rank, self.config)

    # -- the step ----------------------------------------------------------------------------------------------
    def send_buffers(self, plan: StepPlan, routing: RankRouting, local: Sequence[ExampleInputs],
                     dtype: torch.dtype) -> SendBuffers:
        """This rank's text rows and encoder inputs of ``plan`` in send order, on the host: what [`step()`][step]
        sends first, built ahead of it (pure; raises when ``local`` is not what the plan was made from)."""
        return self._send_buffers(plan, routing, local, dtype, "cpu")

    def _send_buffers(self, plan: StepPlan, routing: RankRouting, local: Sequence[ExampleInputs],
                      dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's text rows and encoder inputs in send order; raises when ``local`` is not what the plan
        was made from."""
        config = self.config
        mine = np.flatnonzero(plan.source == self.rank)
        if plan.world != self.world_size or mine.size != len(local):
            raise ValueError(f"the plan has {mine.size} examples on rank {self.rank} but {len(local)} were passed; "
                             "plan and data must come from the same step")
        check_examples(local, config)
        for j, g in enumerate(mine.tolist()):
            if local[j].input_ids.numel() != plan.length[g]:
                raise ValueError(f"example {j}: {local[j].input_ids.numel()} tokens, the plan has {plan.length[g]}; "
                                 "plan and data must come from the same step")
        send = [_text_rows(local[j], config, device) for j in routing.text_send_positions]
        text = torch.cat(send) if send else torch.zeros(0, config.text_columns, dtype=torch.int64, device=device)
        inputs = {}
        for p, spec in config.encoders.items():
            items = [t for ex in local for t in ex.media.get(p, ())]
            local_ids = np.flatnonzero(plan.source[plan.items[p].example] == self.rank)
            if [int(t.shape[0]) for t in items] != plan.items[p].rows[local_ids].tolist():
                raise ValueError(f"{p} items have {[int(t.shape[0]) for t in items]} rows, the plan has "
                                 f"{plan.items[p].rows[local_ids].tolist()}; plan and data must come from the same "
                                 "step")
            ordered = [items[k].to(device=device, dtype=dtype) for k in routing.in_send_items[p]]
            inputs[p] = torch.cat(ordered) if ordered else torch.zeros(0, spec.input_dim, dtype=dtype, device=device)
        return text, inputs

    def step(self, plan: StepPlan, local: Sequence[ExampleInputs], encoders: Mapping[str, Encoder], *,
             dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
             routing: RankRouting | None = None, send: SendBuffers | None = None) -> LLMInputs:
        """Move the data of ``plan``, run the encoders, route their outputs. Collective on ``group``.

        Issues, in this order on every rank: one text all-to-all (token ids, labels and every token field), one
        input all-to-all per encoder phase, one differentiable all-to-all of all encoder outputs (its backward:
        one more, in ``loss.backward()``); plus one small all_gather before it when ``config.output_dim`` is
        unset. A rank that fails anywhere in between still enters them all, and every rank raises after the
        output exchange (NOTE [ Failures inside a step ]). ``routing``: ``rank_routing(plan, rank)`` when it was
        computed ahead (pure: the same either way); ``send``: [`send_buffers()`][send_buffers] of this step built ahead
        (on the host: moved to ``device`` here).
        """
        config = self.config
        dtype = dtype or torch.get_default_dtype()
        routing = rank_routing(plan, self.rank) if routing is None else routing
        failure: BaseException | None = None
        try:
            if send is None:
                text_send, inputs = self._send_buffers(plan, routing, local, dtype, device)
            else:
                text_send, inputs = send[0].to(device), {p: x.to(device) for p, x in send[1].items()}
        except Exception as exc:  # noqa: BLE001 - this rank sends zeros shaped by the plan, reports it below
            failure = exc
            text_send = torch.zeros(sum(routing.text_send), config.text_columns, dtype=torch.int64, device=device)
            inputs = {p: torch.zeros(sum(routing.in_send[p]), spec.input_dim, dtype=dtype, device=device)
                      for p, spec in config.encoders.items()}
        # 1. text (+ token fields), to the LLM rank; 2. encoder inputs, to the encoder rank of each item.
        text = all_to_all_rows(text_send, routing.text_send, routing.text_recv, group=self.group)
        rows = {p: all_to_all_rows(inputs[p], routing.in_send[p], routing.in_recv[p], group=self.group)
                for p in config.phases}
        # 3. encoders (every rank, every phase), then ONE exchange of all outputs to the LLM ranks.
        out_rows = {p: int(plan.items[p].out_rows[plan.items[p].dest == self.rank].sum()) for p in config.phases}
        encoded = None
        if failure is None:
            try:
                encoded = _run_encoders(encoders, rows, routing.enc_item_rows, routing.enc_item_meta, out_rows,
                                        config)
                widths = {tuple(y.shape[1:]) for y in encoded.values()} | (
                    {(config.output_dim,)} if config.output_dim is not None and encoded else set())
                if len(widths) > 1:
                    raise ValueError(f"encoder outputs have widths {sorted(widths)} (OrchestratorConfig.output_dim="
                                     f"{config.output_dim}); project every phase to the LLM hidden size so they "
                                     "share one exchange")
            except Exception as exc:  # noqa: BLE001 - reported in the output exchange
                failure, encoded = exc, None
        received = self._exchange_outputs(routing, encoded, failure, dtype, device)
        pieces = list(torch.split(text, routing.llm_lengths)) if routing.llm_lengths else []
        media = {p: received.index_select(0, torch.from_numpy(routing.media_index[p]).to(device))
                 for p in config.phases}
        return LLMInputs(example_ids=routing.llm_examples.tolist(), input_ids=[t[:, 0] for t in pieces],
                         labels=[t[:, 1] for t in pieces], media=media, media_counts=routing.media_counts,
                         total_loss_tokens=plan.total_loss_tokens, token_fields=_split_text(pieces, config),
                         media_item_rows={p: plan.items[p].out_rows[routing.llm_items[p]].tolist()
                                          for p in config.phases},
                         media_item_meta={p: plan.items[p].meta[routing.llm_items[p]] for p in config.phases})

    def _exchange_outputs(self, routing: RankRouting, encoded: dict[str, torch.Tensor] | None,
                          failure: BaseException | None, dtype: torch.dtype, device: torch.device | str
                          ) -> torch.Tensor:
        """The output all-to-all, with every rank's status (NOTE [ Failures inside a step ]); raises on every
        rank when any rank failed."""
        config, where = self.config, "in this step's data exchange or encoders"
        width = config.output_dim
        if width is None:  # the width is unknown to a failed rank: share the status first
            table = self._all_gather(detail_row(failure), device)
            raise_shared(table, failure, rank=self.rank, where=where)
            width = next((int(y.shape[1]) for y in encoded.values()), 1) if encoded else 1
        total = sum(routing.out_send)
        if encoded is None:  # this rank failed: zeros of the planned shape keep the exchange whole
            cat = torch.zeros(total, width, dtype=dtype, device=device)
        else:
            cat = torch.cat(list(encoded.values())) if encoded else torch.zeros(0, width, dtype=dtype, device=device)
        send = cat.index_select(0, torch.from_numpy(routing.out_send_index).to(device))
        if config.output_dim is None:
            return all_to_all_rows(send, routing.out_send, routing.out_recv, group=self.group)
        # A failed rank sends zeros in the step's dtype: every rank sends that dtype, or the exchange's element
        # sizes would disagree (autocast may hand back another).
        send = send.to(dtype)
        head = header_rows(failure, width, dtype=send.dtype, device=device)
        h = head.shape[0]
        chunks = torch.split(send, routing.out_send)
        send = torch.cat([part for chunk in chunks for part in (head, chunk)])
        received = all_to_all_rows(send, [n + h for n in routing.out_send], [n + h for n in routing.out_recv],
                                   group=self.group)
        parts = torch.split(received, [n + h for n in routing.out_recv])
        reports = np.stack([read_header(part[:h]) for part in parts])
        raise_shared(reports, failure, rank=self.rank, where=where)
        return torch.cat([part[h:] for part in parts])
