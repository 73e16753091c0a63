"""Global orchestrator for multi-phase models (vision encoder, audio encoder, LLM): a balanced plan per phase.

One step, on every rank of ``group``:

1. ``gather_metadata`` -- the only exchange planning needs: per example its LLM length, supervised tokens
   and the input rows of each media item (image patches, audio frames).
2. ``plan_step`` -- pure: one :func:`~evenflow.balance.planners.plan_balance` per phase. Images go to
   balanced *vision* ranks, audio clips to balanced *audio* ranks, examples to balanced *LLM* ranks. It needs
   metadata only, so the plan for step t+1 can be computed (e.g. in a thread) while step t runs.
3. ``step`` -- the data moves: text to its LLM rank, each phase's inputs to its encoder rank (one
   ``all_to_all_single`` each), the encoders run, and their outputs go *directly* to the LLM rank of their
   example in ONE differentiable all-to-all for all phases (NOTE [ Composed routing ]).

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
    are summed across ranks (NOTE [ Loss scale ] in :mod:`evenflow.planning.loss`). The encoders have no
    cross-item interaction (no batch norm), so each item's output is the same wherever it is encoded; the
    backward of the all-to-all returns each output's gradient to the rank that encoded it.

Every rank runs every encoder every step, with zero rows if it encodes nothing, so DDP/FSDP collectives on
encoder parameters never diverge (and the all-to-all backward, which every rank must enter, is reached).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..planning.loss import LossTokenRule, count_loss_tokens
from .costs import QuadraticCost
from .dispatch import all_to_all_rows
from .planners import BalanceConfig, loads, plan_balance

__all__ = ["PhaseSpec", "OrchestratorConfig", "ExampleMeta", "ExampleInputs", "PhasePlan", "StepPlan",
           "RankRouting", "LLMInputs", "GlobalOrchestrator", "plan_step", "rank_routing", "encode_metadata",
           "decode_metadata", "local_step", "Encoder"]

Encoder = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]
"""``encoder(rows, item_rows) -> output rows``: ``rows`` packs the items' input rows back to back,
``item_rows[k]`` is item k's row count; item k must yield ``item_rows[k] // downsample`` output rows, computed
from its own rows only."""


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase: its cost model and, for encoder phases, the shape of an input row."""

    cost: QuadraticCost = QuadraticCost()
    """Cost of one item of ``L`` rows (encoders) or tokens (LLM)."""
    input_dim: int = 0
    """Encoder phases: features per input row (patch size, mel bins). Unused for the LLM phase."""
    downsample: int = 1
    """Encoder phases: input rows per output row (e.g. a 2x2 patch merger: 4)."""
    balance: BalanceConfig = BalanceConfig()
    """How this phase is balanced (method, locality)."""

    def __post_init__(self) -> None:
        for name in ("input_dim", "downsample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "input_dim" else 1):
                raise ValueError(f"PhaseSpec.{name} must be an integer >= {0 if name == 'input_dim' else 1}, "
                                 f"got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """Phases and topology. Must be equal on every rank (it is part of the plan)."""

    encoders: Mapping[str, PhaseSpec] = field(default_factory=dict)
    """Encoder phases by name, e.g. ``{"vision": PhaseSpec(...), "audio": PhaseSpec(...)}``; order matters."""
    llm: PhaseSpec = PhaseSpec()
    """The language-model phase; its items are whole examples of ``length`` tokens."""
    ranks_per_node: int | None = None
    """Ranks per node for node-aware placement (``None``: one node). Resolve it at the edge, e.g. with
    :func:`evenflow.balance.topology.topology_from_env`."""
    balance: bool = True
    """``False``: every item stays on its source rank (same code path, no balancing) -- the baseline."""

    def __post_init__(self) -> None:
        for name, spec in self.encoders.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"encoder phase names must be non-empty strings, got {name!r}")
            if not isinstance(spec, PhaseSpec):
                raise ValueError(f"encoders[{name!r}] must be a PhaseSpec, got {type(spec).__name__}")
            if spec.input_dim < 1:
                raise ValueError(f"encoders[{name!r}].input_dim must be >= 1 (features per input row) so that "
                                 "ranks receiving no items can still allocate the exchange buffers")

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.encoders)


@dataclass(frozen=True)
class ExampleMeta:
    """What planning knows about one example."""

    length: int
    """LLM tokens, placeholders included."""
    loss_tokens: int
    """Supervised tokens (NOTE [ Loss scale ])."""
    media: tuple[tuple[int, ...], ...] = ()
    """Per encoder phase (config order): input rows of each item, in placeholder order."""


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


# -- metadata exchange ---------------------------------------------------------------------------------------

def encode_metadata(metas: Sequence[ExampleMeta], num_phases: int) -> np.ndarray:
    """Flatten to int64: ``[E, (length, loss_tokens, (count, rows...) per phase) per example]``."""
    out = [len(metas)]
    for i, m in enumerate(metas):
        if len(m.media) != num_phases:
            raise ValueError(f"example {i}: media has {len(m.media)} phases, the config has {num_phases}; build "
                             "metadata with ExampleInputs.meta(config)")
        out += [m.length, m.loss_tokens]
        for rows in m.media:
            out += [len(rows), *rows]
    return np.asarray(out, dtype=np.int64)


def decode_metadata(arr: np.ndarray, num_phases: int) -> list[ExampleMeta]:
    vals = arr.tolist()
    count, p = vals[0], 1
    metas = []
    for _ in range(count):
        length, loss_tokens = vals[p], vals[p + 1]
        p += 2
        media = []
        for _ in range(num_phases):
            k = vals[p]
            media.append(tuple(vals[p + 1:p + 1 + k]))
            p += 1 + k
        metas.append(ExampleMeta(length, loss_tokens, tuple(media)))
    return metas


# -- the plan (pure) -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PhasePlan:
    """Items of one encoder phase, in global order (source rank, example, item)."""

    example: np.ndarray
    """Global example id of each item."""
    rows: np.ndarray
    """Input rows of each item."""
    out_rows: np.ndarray
    """Output rows (``rows // downsample``)."""
    dest: np.ndarray
    """Encoder rank of each item."""


@dataclass(frozen=True)
class StepPlan:
    """The routing of one step, identical on every rank. Examples are in global order (source, position)."""

    world: int
    phases: tuple[str, ...]
    source: np.ndarray
    position: np.ndarray
    length: np.ndarray
    loss_tokens: np.ndarray
    dest: np.ndarray
    """LLM rank of each example."""
    items: Mapping[str, PhasePlan]
    phase_costs: Mapping[str, np.ndarray]
    """Per phase (and ``"llm"``), the cost of every item: for reporting loads before and after."""

    @property
    def total_loss_tokens(self) -> int:
        """Supervised tokens of the whole step: the loss denominator on every rank."""
        return int(self.loss_tokens.sum())

    def fingerprint(self) -> str:
        """A hash of the routing; equal on every rank iff the plans are equal."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((self.world, self.phases)).encode())
        for arr in (self.source, self.position, self.length, self.loss_tokens, self.dest):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        for p in self.phases:
            for arr in (self.items[p].example, self.items[p].rows, self.items[p].dest):
                h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        return h.hexdigest()

    def phase_loads(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per phase, ``(loads before, loads after)`` per rank under that phase's cost model."""
        out = {}
        for p in self.phases:
            it = self.items[p]
            before = self.source[it.example]
            out[p] = (loads(self.phase_costs[p], before, self.world), loads(self.phase_costs[p], it.dest, self.world))
        out["llm"] = (loads(self.phase_costs["llm"], self.source, self.world),
                      loads(self.phase_costs["llm"], self.dest, self.world))
        return out


def plan_step(meta_by_rank: Sequence[Sequence[ExampleMeta]], config: OrchestratorConfig) -> StepPlan:
    """One balanced plan per phase from everyone's metadata. Pure and deterministic (same plan on every rank).

    >>> cfg = OrchestratorConfig(encoders={"vision": PhaseSpec(input_dim=4)})
    >>> meta = [[ExampleMeta(6, 3, ((8,),)), ExampleMeta(6, 3, ((8,),))], [ExampleMeta(2, 1, ((),))]]
    >>> plan = plan_step(meta, cfg)
    >>> plan.dest.tolist(), plan.items["vision"].dest.tolist()  # LLM loads 12 | 2 -> 6 | 8; images 16 | 0 -> 8 | 8
    ([1, 0, 1], [0, 1])
    """
    world = len(meta_by_rank)
    if world == 0:
        raise ValueError("meta_by_rank is empty: pass one list of ExampleMeta per rank")
    phases = config.phases
    src, pos, length, loss_tokens = [], [], [], []
    item_ex: dict[str, list[int]] = {p: [] for p in phases}
    item_rows: dict[str, list[int]] = {p: [] for p in phases}
    for r, metas in enumerate(meta_by_rank):
        for j, m in enumerate(metas):
            e = len(src)
            if m.length < 1:
                raise ValueError(f"rank {r}, example {j}: length {m.length} is not positive")
            if len(m.media) != len(phases):
                raise ValueError(f"rank {r}, example {j}: metadata has {len(m.media)} media phases, the config has "
                                 f"{len(phases)} ({phases}); every rank must use the same OrchestratorConfig")
            src.append(r)
            pos.append(j)
            length.append(m.length)
            loss_tokens.append(m.loss_tokens)
            for p, rows in zip(phases, m.media):
                down = config.encoders[p].downsample
                for k, n_rows in enumerate(rows):
                    if n_rows < 0 or n_rows % down:
                        raise ValueError(f"rank {r}, example {j}, {p} item {k}: {n_rows} input rows is not a "
                                         f"non-negative multiple of downsample={down}; pad or crop the item")
                    item_ex[p].append(e)
                    item_rows[p].append(n_rows)
    source = np.asarray(src, dtype=np.int64)
    length_a = np.asarray(length, dtype=np.int64)
    costs = {"llm": config.llm.cost(length_a.astype(np.float64)) if length_a.size else np.zeros(0)}
    if config.balance and source.size:
        dest = np.asarray(plan_balance(costs["llm"], source, world, ranks_per_node=config.ranks_per_node,
                                       item_bytes=length_a, config=config.llm.balance), dtype=np.int64)
    else:
        dest = source.copy()
    items = {}
    for p in phases:
        spec = config.encoders[p]
        ex = np.asarray(item_ex[p], dtype=np.int64)
        rows = np.asarray(item_rows[p], dtype=np.int64)
        costs[p] = spec.cost(rows.astype(np.float64)) if rows.size else np.zeros(0)
        if config.balance and ex.size:
            item_dest = np.asarray(plan_balance(costs[p], source[ex], world, ranks_per_node=config.ranks_per_node,
                                                item_bytes=rows * spec.input_dim, config=spec.balance), dtype=np.int64)
        else:
            item_dest = source[ex].copy()
        items[p] = PhasePlan(example=ex, rows=rows, out_rows=rows // spec.downsample, dest=item_dest)
    return StepPlan(world=world, phases=phases, source=source, position=np.asarray(pos, dtype=np.int64),
                    length=length_a, loss_tokens=np.asarray(loss_tokens, dtype=np.int64), dest=dest, items=items,
                    phase_costs=costs)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)``: ``_ranges([5, 0], [2, 3])`` -> ``[5, 6, 0, 1, 2]``."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return np.arange(total, dtype=np.int64) + offsets


def _starts(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64) if len(counts) else np.zeros(0, np.int64)


@dataclass(frozen=True)
class RankRouting:
    """Everything one rank needs to run a step: orders, split sizes, row indices. Pure, from a :class:`StepPlan`."""

    rank: int
    text_send_positions: list[int]
    """Local example positions in send order (by LLM rank)."""
    text_send: list[int]
    text_recv: list[int]
    """Tokens to / from each rank."""
    llm_examples: np.ndarray
    """Global ids of the examples this rank trains, in order."""
    llm_lengths: list[int]
    in_send_items: dict[str, list[int]]
    """Per phase, local item indices (flattened over local examples) in send order."""
    in_send: dict[str, list[int]]
    in_recv: dict[str, list[int]]
    enc_item_rows: dict[str, list[int]]
    """Per phase, input rows of each item this rank encodes, in arrival order."""
    out_send_index: np.ndarray
    """Rows of ``cat(encoder outputs over phases)`` in send order."""
    out_send: list[int]
    out_recv: list[int]
    media_index: dict[str, np.ndarray]
    """Per phase, rows of the received buffer in (LLM example, item) order."""
    media_counts: dict[str, list[int]]
    """Per phase, output rows per LLM example."""


def rank_routing(plan: StepPlan, rank: int) -> RankRouting:
    """Derive one rank's orders and split sizes from the global plan (NOTE [ Composed routing ])."""
    W = plan.world
    mine = np.flatnonzero(plan.source == rank)
    send_order = mine[np.argsort(plan.dest[mine], kind="stable")]
    text_send = np.bincount(plan.dest[mine], weights=plan.length[mine], minlength=W).astype(np.int64)
    llm_ex = np.flatnonzero(plan.dest == rank)
    text_recv = np.bincount(plan.source[llm_ex], weights=plan.length[llm_ex], minlength=W).astype(np.int64)
    in_send_items, in_send, in_recv, enc_rows = {}, {}, {}, {}
    out_blocks = []  # (phase offset rows, enc-local positions) to assemble the send index
    recv_tables = []  # per (source v, phase): item ids arriving, in order
    phase_offset = 0
    out_send = np.zeros(W, dtype=np.int64)
    enc_items_by_phase = {}
    for p in plan.phases:
        it = plan.items[p]
        local = np.flatnonzero(plan.source[it.example] == rank)  # global ids; local index = position in `local`
        order = np.argsort(it.dest[local], kind="stable")
        in_send_items[p] = order.tolist()
        in_send[p] = np.bincount(it.dest[local], weights=it.rows[local], minlength=W).astype(np.int64).tolist()
        enc = np.flatnonzero(it.dest == rank)
        enc_items_by_phase[p] = enc
        enc_rows[p] = it.rows[enc].tolist()
        in_recv[p] = np.bincount(plan.source[it.example[enc]], weights=it.rows[enc], minlength=W).astype(np.int64).tolist()
        llm_dest = plan.dest[it.example[enc]]
        out_starts = _starts(it.out_rows[enc]) + phase_offset
        out_blocks.append((llm_dest, out_starts, it.out_rows[enc]))
        out_send += np.bincount(llm_dest, weights=it.out_rows[enc], minlength=W).astype(np.int64)
        phase_offset += int(it.out_rows[enc].sum())
    # Send buffer: for each destination d, for each phase, that phase's items bound for d (arrival order).
    index_parts = []
    for d in range(W):
        for llm_dest, starts, counts in out_blocks:
            sel = llm_dest == d
            index_parts.append(_ranges(starts[sel], counts[sel]))
    out_send_index = np.concatenate(index_parts) if index_parts else np.zeros(0, dtype=np.int64)
    # Receive buffer: for each source v, for each phase, items (encoded on v, example trained here) by id.
    media_index, media_counts = {}, {}
    row = 0
    arrival = {p: ([], []) for p in plan.phases}  # per phase: item ids, their starting row in the buffer
    out_recv = np.zeros(W, dtype=np.int64)
    for v in range(W):
        for p in plan.phases:
            it = plan.items[p]
            ids = np.flatnonzero((it.dest == v) & (plan.dest[it.example] == rank))
            starts = row + _starts(it.out_rows[ids])
            arrival[p][0].append(ids)
            arrival[p][1].append(starts)
            n_rows = int(it.out_rows[ids].sum())
            row += n_rows
            out_recv[v] += n_rows
    for p in plan.phases:
        it = plan.items[p]
        ids = np.concatenate(arrival[p][0]) if arrival[p][0] else np.zeros(0, np.int64)
        starts = np.concatenate(arrival[p][1]) if arrival[p][1] else np.zeros(0, np.int64)
        order = np.argsort(ids, kind="stable")  # global id order = (LLM example, item) order
        ids, starts = ids[order], starts[order]
        media_index[p] = _ranges(starts, it.out_rows[ids])
        per_example = np.bincount(np.searchsorted(llm_ex, it.example[ids]), weights=it.out_rows[ids],
                                  minlength=llm_ex.size).astype(np.int64) if ids.size else np.zeros(llm_ex.size, np.int64)
        media_counts[p] = per_example.tolist()
    return RankRouting(rank=rank, text_send_positions=plan.position[send_order].tolist(), text_send=text_send.tolist(),
                       text_recv=text_recv.tolist(), llm_examples=llm_ex, llm_lengths=plan.length[llm_ex].tolist(),
                       in_send_items=in_send_items, in_send=in_send, in_recv=in_recv, enc_item_rows=enc_rows,
                       out_send_index=out_send_index, out_send=out_send.tolist(), out_recv=out_recv.tolist(),
                       media_index=media_index, media_counts=media_counts)


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
