"""The step plan: one balanced placement per phase from every rank's metadata (pure, identical on every rank).

NOTE [ Locality slack in units of the mean ]
    The planners keep an item on its source rank when that raises the phase's max load by at most
    ``locality_tolerance`` of the balanced plan's max (NOTE [ Locality ] in evenflow.balance.locality). When
    one indivisible item bounds a phase, that max is far above the mean: at 2,560 ranks a 3 MP photo is 3.5
    times a rank's mean vision load, and 2 % of it let every other rank fill up to 1.02 times that photo
    (measured: vision 3.575 against a bound of 3.510; benchmarks/bench_vlm_sim.py). The step is as slow as the
    slowest rank, so the plan is 2 % slower than it needs to be while it moves 2.5 % of the bytes instead of
    75 %. The orchestrator therefore reads a phase's tolerance in units of its *mean* load: it hands the
    planner ``tol * mean / bound`` (``bound`` = max(largest item, mean)), so the plan's max load is at most
    the balanced one plus ``tol`` of a mean rank's -- the same as before when no item dominates (``bound``
    = mean), and within ``bound + tol`` when one does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from itertools import chain
from operator import attrgetter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .meta import ExampleMeta, OrchestratorConfig, PhaseSpec
from ..planners import BalanceConfig, loads, lower_bound, plan_balance

__all__ = ["PhasePlan", "StepPlan", "PhaseBalance", "plan_step"]


@dataclass(frozen=True)
class PhasePlan:
    """Items of one encoder phase, in global order (source rank, example, item)."""

    example: np.ndarray
    """Global example id of each item."""
    rows: np.ndarray
    """Input rows of each item."""
    out_rows: np.ndarray
    """Output rows ([`PhaseSpec.out_rows()`][PhaseSpec.out_rows]: ``rows // downsample`` unless the phase states its
    rule)."""
    dest: np.ndarray
    """Encoder rank of each item."""
    meta: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    """``[items, meta_width]`` integers per item (grids), as the source rank reported them."""


@dataclass(frozen=True)
class PhaseBalance:
    """One phase's loads under its cost model, as max / mean over ranks (1.0 is perfect)."""

    before: float
    """Where the items were (their source ranks)."""
    after: float
    """Where the plan puts them."""
    bound: float
    """The indivisible-item bound ``max(largest item, mean) / mean``: no plan does better."""


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
            for arr in (self.items[p].example, self.items[p].rows, self.items[p].dest, self.items[p].meta):
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

    def imbalance(self) -> dict[str, PhaseBalance]:
        """Per phase (and ``"llm"``): max / mean load before and after the plan, and the bound no plan beats.

        >>> cfg = OrchestratorConfig(encoders={"vision": PhaseSpec(input_dim=4)})
        >>> plan = plan_step([[ExampleMeta(6, 3, ((8, 8),))], [ExampleMeta(6, 3, ((),))]], cfg)
        >>> plan.imbalance()["vision"]
        PhaseBalance(before=2.0, after=1.0, bound=1.0)
        """
        out = {}
        for p, (before, after) in self.phase_loads().items():
            mean = float(before.sum()) / self.world
            if mean <= 0:
                out[p] = PhaseBalance(1.0, 1.0, 1.0)
                continue
            out[p] = PhaseBalance(before=float(before.max()) / mean, after=float(after.max()) / mean,
                                  bound=lower_bound(self.phase_costs[p], self.world) / mean)
        return out


@dataclass
class _Flat:
    """Everyone's metadata flattened to global order: examples, and per phase the items."""

    source: np.ndarray
    position: np.ndarray
    length: np.ndarray
    loss_tokens: np.ndarray
    item_example: dict[str, np.ndarray]
    item_rows: dict[str, np.ndarray]
    item_meta: dict[str, np.ndarray]


def _ints(values, count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


def _flatten(meta_by_rank: Sequence[Sequence[ExampleMeta]], config: OrchestratorConfig) -> _Flat:
    """Arrays in global order. One pass per field over the examples (no per-item Python work), so 2,560 ranks
    of a few examples each flatten in milliseconds; errors name the rank, the example and the item."""
    phases = config.phases
    counts = np.fromiter((len(m) for m in meta_by_rank), dtype=np.int64, count=len(meta_by_rank))
    flat = [m for metas in meta_by_rank for m in metas]
    n = len(flat)
    source = np.repeat(np.arange(len(meta_by_rank), dtype=np.int64), counts)
    position = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)

    def where(e: int) -> str:
        return f"rank {int(source[e])}, example {int(position[e])}"

    length = _ints((m.length for m in flat), n)
    if n and length.min() < 1:
        e = int(np.argmin(length))
        raise ValueError(f"{where(e)}: length {int(length[e])} is not positive")
    wrong = np.flatnonzero(np.fromiter(map(len, map(attrgetter("media"), flat)), dtype=np.int64, count=n)
                           != len(phases)).tolist()
    if wrong:
        raise ValueError(f"{where(wrong[0])}: metadata has {len(flat[wrong[0]].media)} media phases, the config has "
                         f"{len(phases)} ({phases}); every rank must use the same OrchestratorConfig")
    item_example, item_rows, item_meta = {}, {}, {}
    for i, (p, spec) in enumerate(config.encoders.items()):
        per_example = [m.media[i] for m in flat]
        k = _ints(map(len, per_example), n)
        total = int(k.sum())
        rows = _ints(chain.from_iterable(per_example), total)
        example = np.repeat(np.arange(n, dtype=np.int64), k)
        bad = np.flatnonzero((rows < 0) | (rows % spec.downsample != 0))
        if bad.size:
            j = int(bad[0])
            item = j - int(np.cumsum(k)[example[j]] - k[example[j]])
            raise ValueError(f"{where(int(example[j]))}, {p} item {item}: {int(rows[j])} input rows is not a "
                             f"non-negative multiple of downsample={spec.downsample}; pad or crop the item")
        width = spec.meta_width
        if width:
            metas = [m.item_meta(i, width) for m in flat]
            items = list(chain.from_iterable(metas))
            if not np.array_equal(_ints(map(len, metas), n), k) or set(map(len, items)) - {width}:
                short = [e for e, (x, r) in enumerate(zip(metas, per_example)) if len(x) != len(r)
                         or any(len(v) != width for v in x)]
                raise ValueError(f"{where(short[0])}, {p}: item metadata {metas[short[0]]} is not {k[short[0]]} "
                                 f"tuples of {width} integers (PhaseSpec.meta_width)")
            meta = _ints(chain.from_iterable(items), total * width).reshape(total, width)
        else:
            meta = np.zeros((total, 0), dtype=np.int64)
        item_example[p], item_rows[p], item_meta[p] = example, rows, meta
    return _Flat(source, position, length, _ints((m.loss_tokens for m in flat), n), item_example, item_rows,
                 item_meta)


def _mean_slack(balance: BalanceConfig, costs: np.ndarray, world: int) -> BalanceConfig:
    """``balance`` with its locality tolerance read in units of the phase's mean load (NOTE [ Locality slack
    in units of the mean ])."""
    tol = balance.locality_tolerance
    bound = lower_bound(costs, world)
    if not tol or bound <= 0:
        return balance
    return dataclasses.replace(balance, locality_tolerance=tol * (float(costs.sum()) / world) / bound)


def _place(costs: np.ndarray, source: np.ndarray, item_bytes: np.ndarray, spec: PhaseSpec,
           config: OrchestratorConfig, world: int, *, rows: np.ndarray | None = None, phase: str = "llm"
           ) -> np.ndarray:
    """Destination rank of each item of one phase; its source rank when the phase is not balanced.

    With ``max_rows_per_rank`` the balancer works under that cap on each rank's input rows. The loader's
    budget let every source rank hold its own items, so when the greedy balancer finds no room under the cap,
    the items stay home; only a rank over the cap at home is an error.
    """
    cap = spec.max_rows_per_rank if rows is not None else None
    dest = source.copy()
    if config.balance and spec.balanced and source.size:
        try:
            dest = np.asarray(plan_balance(costs, source, world, ranks_per_node=config.ranks_per_node,
                                           item_bytes=item_bytes, cap=cap,
                                           cap_weights=rows.astype(np.float64) if cap is not None else None,
                                           config=_mean_slack(spec.balance, costs, world)), dtype=np.int64)
        except ValueError:
            if cap is None:
                raise
    if cap is not None and source.size:
        held = np.bincount(dest, weights=rows, minlength=world)
        if held.max() > cap:
            r = int(held.argmax())
            raise ValueError(f"{phase}: rank {r} holds {int(held[r])} input rows in this step, over "
                             f"max_encoder_rows={cap} (the phase's max_rows_per_rank); give the loader the same "
                             "budget (DynamicBatchLoader(max_encoder_rows=)) so no rank gets more at home, or raise "
                             "max_encoder_rows")
    return dest


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
    source, length = flat.source, flat.length
    costs = {"llm": config.llm.costs(length, np.zeros((length.size, 0), dtype=np.int64))}
    dest = _place(costs["llm"], source, length, config.llm, config, world)
    items = {}
    for p in config.phases:
        spec = config.encoders[p]
        ex, rows, meta = flat.item_example[p], flat.item_rows[p], flat.item_meta[p]
        costs[p] = spec.costs(rows, meta)
        item_dest = _place(costs[p], source[ex], rows * spec.input_dim, spec, config, world, rows=rows, phase=p)
        items[p] = PhasePlan(example=ex, rows=rows, out_rows=spec.out_rows(rows, meta), dest=item_dest, meta=meta)
    return StepPlan(world=world, phases=config.phases, source=source, position=flat.position, length=length,
                    loss_tokens=flat.loss_tokens, dest=dest, items=items, phase_costs=costs)
