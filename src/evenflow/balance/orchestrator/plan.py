"""The step plan: one balanced placement per phase from every rank's metadata (pure, identical on every rank)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .meta import ExampleMeta, OrchestratorConfig, PhaseSpec
from ..planners import loads, plan_balance

__all__ = ["PhasePlan", "StepPlan", "plan_step"]


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


@dataclass
class _Flat:
    """Everyone's metadata flattened to global order: examples, and per phase the items."""

    source: list[int]
    position: list[int]
    length: list[int]
    loss_tokens: list[int]
    item_example: dict[str, list[int]]
    item_rows: dict[str, list[int]]


def _flatten(meta_by_rank: Sequence[Sequence[ExampleMeta]], config: OrchestratorConfig) -> _Flat:
    phases = config.phases
    flat = _Flat([], [], [], [], {p: [] for p in phases}, {p: [] for p in phases})
    for r, metas in enumerate(meta_by_rank):
        for j, m in enumerate(metas):
            e = len(flat.source)
            if m.length < 1:
                raise ValueError(f"rank {r}, example {j}: length {m.length} is not positive")
            if len(m.media) != len(phases):
                raise ValueError(f"rank {r}, example {j}: metadata has {len(m.media)} media phases, the config has "
                                 f"{len(phases)} ({phases}); every rank must use the same OrchestratorConfig")
            flat.source.append(r)
            flat.position.append(j)
            flat.length.append(m.length)
            flat.loss_tokens.append(m.loss_tokens)
            for p, rows in zip(phases, m.media):
                down = config.encoders[p].downsample
                for k, n_rows in enumerate(rows):
                    if n_rows < 0 or n_rows % down:
                        raise ValueError(f"rank {r}, example {j}, {p} item {k}: {n_rows} input rows is not a "
                                         f"non-negative multiple of downsample={down}; pad or crop the item")
                    flat.item_example[p].append(e)
                    flat.item_rows[p].append(n_rows)
    return flat


def _place(costs: np.ndarray, source: np.ndarray, item_bytes: np.ndarray, spec: PhaseSpec,
           config: OrchestratorConfig, world: int) -> np.ndarray:
    """Destination rank of each item of one phase; its source rank when the phase is not balanced."""
    if not (config.balance and spec.balanced and source.size):
        return source.copy()
    return np.asarray(plan_balance(costs, source, world, ranks_per_node=config.ranks_per_node,
                                   item_bytes=item_bytes, config=spec.balance), dtype=np.int64)


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
    flat = _flatten(meta_by_rank, config)
    source = np.asarray(flat.source, dtype=np.int64)
    length = np.asarray(flat.length, dtype=np.int64)
    costs = {"llm": config.llm.cost(length.astype(np.float64)) if length.size else np.zeros(0)}
    dest = _place(costs["llm"], source, length, config.llm, config, world)
    items = {}
    for p in config.phases:
        spec = config.encoders[p]
        ex = np.asarray(flat.item_example[p], dtype=np.int64)
        rows = np.asarray(flat.item_rows[p], dtype=np.int64)
        costs[p] = spec.cost(rows.astype(np.float64)) if rows.size else np.zeros(0)
        item_dest = _place(costs[p], source[ex], rows * spec.input_dim, spec, config, world)
        items[p] = PhasePlan(example=ex, rows=rows, out_rows=rows // spec.downsample, dest=item_dest)
    return StepPlan(world=world, phases=config.phases, source=source,
                    position=np.asarray(flat.position, dtype=np.int64), length=length,
                    loss_tokens=np.asarray(flat.loss_tokens, dtype=np.int64), dest=dest, items=items,
                    phase_costs=costs)
