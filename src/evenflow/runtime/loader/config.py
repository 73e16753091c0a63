"""LoaderConfig, and DynamicBatchLoader's flat keyword arguments turned into it (evenflow.runtime.loader).

The loader takes flat keyword arguments (``token_budget=``, ``join=``, ...); they become one frozen, validated
[`LoaderConfig`][LoaderConfig] -- everything that decides which samples form which batch -- checked at construction in
the order a user hits them: unknown names first (with the evenflow name of a DataLoader argument), then the
config's fields, then the worker arguments. The default collate follows from ``cost``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from ...planning.alignment import AlignmentConfig
from ...planning.grouping import CostModel, GroupingConfig, OversizePolicy
from ...planning.loss import LossTokenRule
from ...planning.shard import ShardLayout
from ...planning.timecost import TimeCost, default_time_cost
from ..collate import FlatCollate, PadCollate
from ..planning import PLANNING_CHOICES, PlanningChoice
from ..samples import AUDIO_FRAMES, ENCODER_ROWS, media_resources

__all__ = ["LoaderConfig"]


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Everything that decides which samples form which batch (plus pipeline depth)."""

    grouping: GroupingConfig
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)
    seed: int = 0
    shuffle: bool = True
    depth: int = 4
    """Ready batches kept ahead of the trainer (back-pressure waits before a round, never inside it)."""
    grad_accum_steps: int = 1
    loss_tokens: LossTokenRule = field(default_factory=LossTokenRule)
    timeout: timedelta = timedelta(minutes=5)
    """Bound on every metadata exchange: a dead or stuck peer makes this rank raise after it."""
    balance: bool = False
    """Move samples between ranks' batches of each step so their costs match, and give ranks that would be
    IDLE real work (evenflow.runtime.balancing). Costs one more small exchange and one all-to-all per round."""
    planning: PlanningChoice = "auto"
    """``"local"``: each rank groups its own buffer. ``"global"``: the ranks of a planning group pool their
    buffers' metadata and group the union (evenflow.runtime.global_round); subsumes ``balance``. ``"auto"``
    (default): resolved once by the loader, from the configuration alone, to ``"global"`` when
    2 <= world size <= 64 (or ``planning_group`` is given), ``balance=False``; else ``"local"`` (NOTE [ The
    default planning policy ] in evenflow.runtime.planning). ``balance=True`` with ``"auto"`` keeps the local
    policy and its rebalancer. The loader's fingerprint records the resolved policy (``loader.planning``)."""
    planning_group: int | None = None
    """Ranks per planning group under global planning (consecutive ranks); ``None``: all ranks up to 64,
    else blocks of 8 (evenflow.runtime.planning.default_planning_group)."""
    time_cost: TimeCost | None = None
    """What global planning balances across the ranks of a step (the token budget stays a hard limit);
    ``None``: [`default_time_cost()`][evenflow.planning.timecost.default_time_cost] of ``cost`` -- padded tokens, or a
    per-sequence ``L + L^2 / 24,576`` summed over each pack (NOTE [ The default time cost ], NOTE [ Packed steps
    balanced on time ]). Its layout must be ``cost``'s (``TimeCost()``, the plain padded-token cost, is accepted
    for either). Part of the resume fingerprint."""
    shard: ShardLayout | None = None
    """The CP/SP split of every batch (from ``mesh=``; NOTE [ Shard-ready rows ] in evenflow.planning.shard):
    the budget is per data-parallel group and a multiple of its unit. Part of the resume fingerprint."""

    def __post_init__(self) -> None:
        if self.planning not in PLANNING_CHOICES:
            raise ValueError(f"planning must be one of {', '.join(map(repr, PLANNING_CHOICES))}, got "
                             f"{self.planning!r}")
        if self.planning_group is not None and (isinstance(self.planning_group, bool)
                                                or not isinstance(self.planning_group, int) or self.planning_group < 1):
            raise ValueError(f"planning_group must be a positive int (ranks per planning group) or None, got "
                             f"{self.planning_group!r}")
        if self.planning == "global" and self.balance:
            raise ValueError("planning='global' already balances every step (it forms the groups over all ranks' "
                             "buffers); pass balance=False with it, or planning='local' with balance=True")
        if self.shard is not None:
            self.shard.check_budget(self.grouping.token_budget)
            if not self.loss_tokens.shift:
                raise ValueError("a mesh with CP/SP trains on pre-shifted shift_labels, which count the causal-LM "
                                 "shift; pass loss_tokens=LossTokenRule(shift=True) (the default)")
        if not isinstance(self.depth, int) or self.depth < 1:
            raise ValueError(f"depth must be an integer >= 1, got {self.depth!r}")
        if not isinstance(self.grad_accum_steps, int) or self.grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got {self.grad_accum_steps!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.time_cost is not None and not isinstance(self.time_cost, TimeCost):
            raise ValueError(f"time_cost must be an evenflow.planning.TimeCost or None, got "
                             f"{type(self.time_cost).__name__}")
        if self.time_cost not in (None, TimeCost()) and self.time_cost.layout != self.grouping.cost:
            shape = "the sum of its sequences'" if self.grouping.cost == "summed" else "rows x its longest row's"
            raise ValueError(f"time_cost has layout={self.time_cost.layout!r} but cost={self.grouping.cost!r}, and a "
                             f"{self.grouping.cost} batch takes {shape} time; build it with layout="
                             f"{self.grouping.cost!r} (TimeCost.from_model(config, layout={self.grouping.cost!r}) "
                             "for a model's FLOPs), or pass time_cost=None")
        missing = [k for k in (self.time_cost.length_keys if self.time_cost else ()) if k != "tokens"
                   and k not in self.grouping.extra_budgets]
        if missing:
            raise ValueError(f"time_cost has phases on {missing}, which the loader measures only for extra_budgets; "
                             "add them to extra_budgets= (with resources_fn=), or drop those phases")

    @property
    def planning_time_cost(self) -> TimeCost:
        """The time cost global planning balances: ``time_cost``, or the default of ``cost``."""
        return self.time_cost if self.time_cost is not None else default_time_cost(self.grouping.cost)


# Arguments users bring from DataLoader / other dynamic batchers, and what evenflow calls them.
_RENAMED = {"batch_size": "token_budget", "max_tokens": "token_budget", "max_tokens_per_batch": "token_budget",
            "max_batch_tokens": "token_budget", "drop_last": "join", "sampler": "shuffle/seed",
            "batch_sampler": "token_budget", "collate": "collate_fn", "generator": "seed",
            "gradient_accumulation_steps": "grad_accum_steps"}


def _unknown_arguments(unknown: Mapping) -> str:
    hints = [f"{k}= -> {_RENAMED[k]}=" for k in unknown if k in _RENAMED]
    text = (f"DynamicBatchLoader got unexpected keyword argument(s) {', '.join(map(repr, unknown))}. Batches are sized "
            "by token_budget=N (padded tokens per batch per rank under cost='padded', summed tokens under "
            "cost='summed'), not by a sample count; cap samples per batch with max_samples=")
    return text + (f" (use {'; '.join(hints)})" if hints else "") + ". See help(evenflow.DynamicBatchLoader)"


def _loader_config(*, token_budget: int, cost: CostModel, max_samples: int | None,
                   extra_budgets: Mapping[str, int] | None, oversize: OversizePolicy, pad_to_multiple_of: int | None,
                   join: bool, max_steps_per_round: int, max_wait_rounds: int, buffer_size: int, seed: int,
                   shuffle: bool, depth: int, grad_accum_steps: int, loss_tokens: LossTokenRule | None,
                   timeout: timedelta, balance: bool, planning: PlanningChoice,
                   planning_group: int | None, time_cost: TimeCost | None = None,
                   shard: ShardLayout | None = None) -> LoaderConfig:
    """The loader's arguments as a [`LoaderConfig`][LoaderConfig] (each part validates itself: grouping, alignment,
    rest)."""
    if shard is not None and cost == "padded":  # padded rows split evenly: the planner costs the rounded width
        pad_to_multiple_of = math.lcm(pad_to_multiple_of or 1, shard.unit)
    grouping = GroupingConfig(token_budget=token_budget, cost=cost, max_samples=max_samples,
                              extra_budgets=dict(extra_budgets or {}), oversize=oversize,
                              pad_to_multiple_of=pad_to_multiple_of)
    alignment = AlignmentConfig(join=join, max_steps_per_round=max_steps_per_round,
                                max_wait_rounds=max_wait_rounds, buffer_size=buffer_size)
    return LoaderConfig(grouping=grouping, alignment=alignment, seed=seed, shuffle=shuffle, depth=depth,
                        grad_accum_steps=grad_accum_steps, loss_tokens=loss_tokens or LossTokenRule(),
                        timeout=timeout, balance=balance, planning=planning, planning_group=planning_group,
                        time_cost=time_cost, shard=shard)


def _encoder_budgets(extra_budgets: Mapping[str, int] | None, max_encoder_rows: int | None) -> dict[str, int]:
    """``extra_budgets`` with ``max_encoder_rows`` as the vision rows' budget (one name for one budget)."""
    out = dict(extra_budgets or {})
    if max_encoder_rows is None:
        return out
    if isinstance(max_encoder_rows, bool) or not isinstance(max_encoder_rows, int) or max_encoder_rows < 1:
        raise ValueError(f"max_encoder_rows must be a positive int (patch rows before merging per batch) or None, "
                         f"got {max_encoder_rows!r}")
    if ENCODER_ROWS in out:
        raise ValueError(f"extra_budgets={{{ENCODER_ROWS!r}: {out[ENCODER_ROWS]}}} and max_encoder_rows="
                         f"{max_encoder_rows} are the same budget; give it once, as max_encoder_rows=")
    out[ENCODER_ROWS] = max_encoder_rows
    return out


def _media_resources_fn(resources_fn: Callable | None, budgets: Mapping[str, int], *, derive: bool
                        ) -> Callable | None:
    """``resources_fn`` that reads encoder rows and audio frames off a sample's grids and clips: always for
    ``max_encoder_rows`` (``derive``), else where neither the user's function nor the sample gives them."""
    media = [name for name in (ENCODER_ROWS, AUDIO_FRAMES) if name in budgets]
    if not media:
        return resources_fn

    def resources(sample: Mapping) -> dict:
        if resources_fn is not None:
            given = dict(resources_fn(sample))
        else:
            missing = [k for k in budgets if k not in sample and k not in media]
            if missing:
                raise ValueError(f"extra_budgets names {missing} but the sample has no such key; add it to the "
                                 "sample or pass resources_fn")
            given = {k: sample[k] for k in budgets if k in sample}
        derived = media_resources(sample)
        for name in media:
            if name not in given or (derive and name == ENCODER_ROWS):
                given[name] = derived[name]
        return given

    return resources


def _check_workers(num_workers: object, worker_timeout: object, timeout: object) -> None:
    """``num_workers``, then ``worker_timeout``: positive, and below ``timeout`` when workers run."""
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if not isinstance(worker_timeout, timedelta) or worker_timeout.total_seconds() <= 0:
        raise ValueError(f"worker_timeout must be a positive datetime.timedelta, got {worker_timeout!r}")
    if num_workers > 0 and isinstance(timeout, timedelta) and worker_timeout >= timeout:
        raise ValueError(f"worker_timeout={worker_timeout} must be shorter than timeout={timeout}: a rank whose "
                         "worker is stuck must report it to its peers before their metadata exchange times out. "
                         "Lower worker_timeout= or raise timeout=")


def _default_collate(cost: CostModel, pad_token_id: int, pad_to_multiple_of: int | None,
                     shard: ShardLayout | None = None) -> Callable:
    """The collate of ``collate_fn=None``: [`PadCollate`][PadCollate] (padded cost) or [`FlatCollate`][FlatCollate]
    (summed),
    shard-ready under a CP/SP mesh."""
    collate_cls = FlatCollate if cost == "summed" else PadCollate
    return collate_cls(pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, shard=shard)
