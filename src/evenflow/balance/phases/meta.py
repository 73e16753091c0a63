"""Orchestrator configuration and the metadata planning needs (pure; see
[`evenflow.balance.phases`][evenflow.balance.phases]).

NOTE [ The plan key ]
    Every rank computes the step's plan on its own from the gathered metadata, so every rank must plan with the
    same configuration -- the cost models above all. Two ranks whose costs differ in the last bit (a warm-up fit
    timed on each rank, a checkpoint loaded on one rank only) compute different plans, and then different split
    sizes for the same all-to-all: gloo hangs or raises somewhere else, NCCL reads garbage. So
    [`OrchestratorConfig.plan_key()`][OrchestratorConfig.plan_key] hashes everything in the configuration that shapes a
    plan (each phase's cost coefficients by ``float.hex``, its row rules, caps and planner settings, the topology, and
    ``cost_key`` for cost models only a rule's closure knows), and the key travels in one word of the metadata
    exchange every step (NOTE [ One metadata exchange ] in
    [`evenflow.exchange.orchestrator`][evenflow.exchange.orchestrator]): a rank whose key differs from rank 0's is named
    in a [`PeerError`][evenflow.PeerError] raised on every rank, before any data moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..costs import QuadraticCost
from ..planners import BalanceConfig

__all__ = ["PhaseSpec", "OrchestratorConfig", "ExampleMeta", "ItemRule", "encode_metadata", "decode_metadata",
           "METADATA_WORDS"]

ItemRule = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``rule(rows, meta) -> one value per item``, vectorized: ``rows`` int64 ``[n]``, ``meta`` int64 ``[n,
meta_width]``. Pure (every rank evaluates it on the same gathered metadata and must get the same answer)."""

METADATA_WORDS = 1024
"""Default width (int64 words per rank) of the metadata exchange: ~40 examples with one image each. A rank
with more metadata costs one more all_gather of the overflow, on every rank (NOTE [ One metadata exchange ])."""
_MIN_METADATA_WORDS = 256  # a failure's detail row (faults.DETAIL_WIDTH = 141 words) must fit without overflow


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    """One phase: its cost model and, for encoder phases, the shape of an item and of its output."""

    cost: QuadraticCost = QuadraticCost()
    """Cost of one item of ``L`` rows (encoders) or tokens (LLM)."""
    input_dim: int = 0
    """Encoder phases: features per input row (patch size, mel bins). Unused for the LLM phase."""
    downsample: int = 1
    """Encoder phases: input rows per output row (e.g. a 2x2 patch merger: 4)."""
    balance: BalanceConfig = BalanceConfig()
    """How this phase is balanced (method, locality). Its ``locality_tolerance`` is read as a fraction of the
    phase's *mean* load per rank (NOTE [ Locality slack in units of the mean ] in ``plan.py``)."""
    balanced: bool = True
    """``False``: this phase's items stay on their source rank while other phases are balanced (e.g. LLM-only
    balancing: encoders with ``balanced=False``). ``OrchestratorConfig.balance=False`` turns off every phase."""
    meta_width: int = 0
    """Encoder phases: integers per item beside its row count (a Qwen2-VL grid with its kind: 4). They travel
    in the metadata exchange, so every rank knows every item's shape; the encoder receives them as a third
    argument ([`Encoder`][evenflow.exchange.Encoder])."""
    output_rows: ItemRule | None = None
    """Encoder phases: output rows per item from ``(rows, meta)``; ``None``: ``rows // downsample``. An audio
    tower whose convolutions round (``(frames - 1) // 2 + 1``...) states it here."""
    item_cost: ItemRule | None = None
    """Cost per item from ``(rows, meta)``; ``None``: ``cost(rows)``. A video whose attention runs per frame
    costs ``t * cost(h * w)``, not ``cost(t * h * w)``."""
    max_rows_per_rank: int | None = None
    """Encoder phases: no rank encodes more input rows than this in one step (the loader's
    ``extra_budgets`` for the same rows, e.g. ``num_patches``): balancing never piles more patches on a rank
    than its budget. ``None``: no cap."""

    def __post_init__(self) -> None:
        for name, low in (("input_dim", 0), ("downsample", 1), ("meta_width", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PhaseSpec.{name} must be an integer >= {low}, got {value!r}")
        cap = self.max_rows_per_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"PhaseSpec.max_rows_per_rank must be a positive integer (input rows) or None, "
                             f"got {cap!r}")
        for name in ("output_rows", "item_cost"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"PhaseSpec.{name} must be a callable (rows, meta) -> array, or None")

    def out_rows(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        """Output rows per item ([`output_rows`][output_rows], default ``rows // downsample``), checked."""
        if self.output_rows is None:
            return rows // self.downsample
        out = np.asarray(self.output_rows(rows, meta))
        if out.shape != rows.shape or (out.size and (not np.issubdtype(out.dtype, np.integer) or out.min() < 0)):
            raise ValueError(f"PhaseSpec.output_rows returned {out.dtype} of shape {out.shape} for {rows.size} "
                             "items; it must return one non-negative integer per item")
        return out.astype(np.int64)

    def costs(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        """Cost per item ([`item_cost`][item_cost], default [`cost`][cost] of the row count)."""
        if not rows.size:
            return np.zeros(0)
        if self.item_cost is None:
            return np.asarray(self.cost(rows.astype(np.float64)), dtype=np.float64)
        out = np.asarray(self.item_cost(rows, meta), dtype=np.float64)
        if out.shape != rows.shape or not np.isfinite(out).all() or out.min() < 0:
            raise ValueError(f"PhaseSpec.item_cost must return one finite non-negative cost per item, got shape "
                             f"{out.shape} for {rows.size} items")
        return out


@dataclass(frozen=True, kw_only=True)
class OrchestratorConfig:
    """Phases and topology. Must be equal on every rank (it is part of the plan)."""

    encoders: Mapping[str, PhaseSpec] = field(default_factory=dict)
    """Encoder phases by name, e.g. ``{"vision": PhaseSpec(...), "audio": PhaseSpec(...)}``; order matters."""
    llm: PhaseSpec = PhaseSpec()
    """The language-model phase; its items are whole examples of ``length`` tokens."""
    ranks_per_node: int | None = None
    """Ranks per node for node-aware placement (``None``: one node). Resolve it at the edge, e.g. with
    [`evenflow.balance.topology.topology_from_env()`][evenflow.balance.topology.topology_from_env]."""
    balance: bool = True
    """``False``: every item stays on its source rank (same code path, no balancing) -- the baseline."""
    token_fields: Mapping[str, int] = field(default_factory=dict)
    """Per-token integer columns moved with the text in its one all-to-all, by name and width, e.g.
    ``{"position_ids": 3}`` for M-RoPE positions. Whatever needs an example's items to compute (positions need
    the grids) is computed on the source rank, where they are, and travels with the tokens."""
    output_dim: int | None = None
    """Width of every encoder's output rows (the LLM hidden size). With it, an encoder that raises on one rank
    is reported to every rank inside the output exchange (NOTE [ Failures inside a step ]); ``None``: the width
    is unknown to a rank whose encoder failed, so that report costs one small all_gather per step."""
    metadata_words: int = METADATA_WORDS
    """int64 words per rank of the one metadata all_gather (NOTE [ One metadata exchange ])."""
    cost_key: str = ""
    """Identity of a cost model the ``PhaseSpec.cost`` fields do not show (coefficients an ``item_cost`` rule
    reads from elsewhere), e.g. `evenflow.planning.TimeCost.key()` of a fitted model: part of
    [`plan_key()`][plan_key] (NOTE [ The plan key ])."""

    def __post_init__(self) -> None:
        for name, spec in self.encoders.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"encoder phase names must be non-empty strings, got {name!r}")
            if not isinstance(spec, PhaseSpec):
                raise ValueError(f"encoders[{name!r}] must be a PhaseSpec, got {type(spec).__name__}")
            if spec.input_dim < 1:
                raise ValueError(f"encoders[{name!r}].input_dim must be >= 1 (features per input row) so that "
                                 "ranks receiving no items can still allocate the exchange buffers")
            if spec.max_rows_per_rank is not None and spec.balance.method in ("lpt_batched", "kk"):
                raise ValueError(f"encoders[{name!r}]: max_rows_per_rank needs a planner that honours a cap; "
                                 f"balance.method={spec.balance.method!r} does not (use 'auto', 'lpt' or 'milp')")
        for name, width in self.token_fields.items():
            if name in ("input_ids", "labels") or not isinstance(name, str) or not name:
                raise ValueError(f"token_fields: {name!r} is not a free column name (input_ids and labels always "
                                 "travel)")
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"token_fields[{name!r}] must be a positive integer (columns), got {width!r}")
        if self.output_dim is not None and (isinstance(self.output_dim, bool) or not isinstance(self.output_dim, int)
                                            or self.output_dim < 1):
            raise ValueError(f"output_dim must be a positive integer (the LLM hidden size) or None, got "
                             f"{self.output_dim!r}")
        if isinstance(self.metadata_words, bool) or not isinstance(self.metadata_words, int) \
                or self.metadata_words < _MIN_METADATA_WORDS:
            raise ValueError(f"metadata_words must be an integer >= {_MIN_METADATA_WORDS} (a failure report must "
                             f"fit), got {self.metadata_words!r}")
        if not isinstance(self.cost_key, str):
            raise ValueError(f"cost_key must be a string (e.g. repr(TimeCost.key())), got "
                             f"{type(self.cost_key).__name__}")

    def plan_key(self) -> int:
        """A 63-bit hash of everything here that shapes a plan; equal on two ranks iff they plan alike
        (NOTE [ The plan key ]). Rules (``output_rows``, ``item_cost``) count by their qualified name: the
        coefficients they read belong in ``cost_key``."""
        h = hashlib.blake2b(digest_size=8)
        for name, spec in (*self.encoders.items(), ("", self.llm)):
            h.update(repr((name, _spec_identity(spec))).encode())
        h.update(repr((self.ranks_per_node, self.balance, sorted(self.token_fields.items()), self.output_dim,
                       self.metadata_words, self.cost_key)).encode())
        return int.from_bytes(h.digest(), "little") >> 1  # fits an int64 word of the exchange

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.encoders)

    @property
    def meta_widths(self) -> tuple[int, ...]:
        return tuple(spec.meta_width for spec in self.encoders.values())

    @property
    def text_columns(self) -> int:
        """Columns of the text exchange: ``input_ids``, ``labels``, then every token field."""
        return 2 + sum(self.token_fields.values())


def _spec_identity(spec: PhaseSpec) -> tuple:
    def rule(fn: ItemRule | None) -> str | None:
        return None if fn is None else getattr(fn, "__qualname__", type(fn).__qualname__)

    cost = tuple(float(getattr(spec.cost, f)).hex() for f in ("gamma", "alpha", "beta"))
    return (cost, spec.input_dim, spec.downsample, spec.meta_width, spec.balanced, spec.max_rows_per_rank,
            repr(spec.balance), rule(spec.output_rows), rule(spec.item_cost))


@dataclass(frozen=True)
class ExampleMeta:
    """What planning knows about one example."""

    length: int
    """LLM tokens, placeholders included."""
    loss_tokens: int
    """Supervised tokens (NOTE [ Loss scale ])."""
    media: tuple[tuple[int, ...], ...] = ()
    """Per encoder phase (config order): input rows of each item, in placeholder order."""
    media_meta: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Per encoder phase, per item, its ``meta_width`` integers (``()`` for a phase without item metadata; the
    whole field may be ``()`` when no phase has any)."""

    def item_meta(self, phase: int, width: int) -> tuple[tuple[int, ...], ...]:
        """The metadata of phase ``phase``'s items, ``()`` each when the phase has none."""
        if not self.media_meta:
            if width:
                raise ValueError(f"phase {phase} has meta_width={width} but the example carries no item metadata")
            return tuple(() for _ in self.media[phase])
        return self.media_meta[phase]


def encode_metadata(metas: Sequence[ExampleMeta], num_phases: int, *,
                    meta_widths: Sequence[int] | None = None) -> np.ndarray:
    """Flatten to int64: ``[E, (length, loss_tokens, (count, rows..., meta...) per phase) per example]``.

    >>> encode_metadata([ExampleMeta(7, 3, ((8, 4), ()))], 2).tolist()
    [1, 7, 3, 2, 8, 4, 0]
    >>> encode_metadata([ExampleMeta(7, 3, ((8,),), (((1, 2, 4),),))], 1, meta_widths=[3]).tolist()
    [1, 7, 3, 1, 8, 1, 2, 4]
    """
    widths = list(meta_widths) if meta_widths is not None else [0] * num_phases
    if len(widths) != num_phases:
        raise ValueError(f"meta_widths has {len(widths)} entries for {num_phases} phases")
    out = [len(metas)]
    for i, m in enumerate(metas):
        if len(m.media) != num_phases:
            raise ValueError(f"example {i}: media has {len(m.media)} phases, the config has {num_phases}; build "
                             "metadata with ExampleInputs.meta(config)")
        out += [m.length, m.loss_tokens]
        for p, (rows, width) in enumerate(zip(m.media, widths)):
            out += [len(rows), *rows]
            metas_p = m.item_meta(p, width)
            if len(metas_p) != len(rows) or any(len(v) != width for v in metas_p):
                raise ValueError(f"example {i}, phase {p}: item metadata {metas_p} is not {len(rows)} tuples of "
                                 f"{width} integers (PhaseSpec.meta_width)")
            for v in metas_p:
                out += list(v)
    return np.asarray(out, dtype=np.int64)


def decode_metadata(arr: np.ndarray, num_phases: int, *, meta_widths: Sequence[int] | None = None
                    ) -> list[ExampleMeta]:
    """Inverse of [`encode_metadata()`][encode_metadata] (trailing padding is ignored)."""
    widths = list(meta_widths) if meta_widths is not None else [0] * num_phases
    vals = arr.tolist()
    count, p = vals[0], 1
    metas = []
    for _ in range(count):
        length, loss_tokens = vals[p], vals[p + 1]
        p += 2
        media, media_meta = [], []
        for width in widths:
            k = vals[p]
            media.append(tuple(vals[p + 1:p + 1 + k]))
            p += 1 + k
            media_meta.append(tuple(tuple(vals[p + j * width:p + (j + 1) * width]) for j in range(k)))
            p += k * width
        metas.append(ExampleMeta(length, loss_tokens, tuple(media), tuple(media_meta) if any(widths) else ()))
    return metas
