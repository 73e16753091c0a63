"""Orchestrator configuration and the metadata planning needs (pure; see :mod:`evenflow.balance.orchestrator`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..costs import QuadraticCost
from ..planners import BalanceConfig

__all__ = ["PhaseSpec", "OrchestratorConfig", "ExampleMeta", "encode_metadata", "decode_metadata"]


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
    balanced: bool = True
    """``False``: this phase's items stay on their source rank while other phases are balanced (e.g. LLM-only
    balancing: encoders with ``balanced=False``). ``OrchestratorConfig.balance=False`` turns off every phase."""

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


def encode_metadata(metas: Sequence[ExampleMeta], num_phases: int) -> np.ndarray:
    """Flatten to int64: ``[E, (length, loss_tokens, (count, rows...) per phase) per example]``.

    >>> encode_metadata([ExampleMeta(7, 3, ((8, 4), ()))], 2).tolist()
    [1, 7, 3, 2, 8, 4, 0]
    """
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
    """Inverse of :func:`encode_metadata` (trailing padding is ignored)."""
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
