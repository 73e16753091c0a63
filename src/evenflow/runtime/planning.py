"""Which planning policy a loader runs, its planning groups, and the check that every rank agrees on both.

Light on purpose: every loader imports this; only a loader that runs ``"global"`` imports
evenflow.runtime.global_round (and scipy), at construction, so the first round does not stall on an import.
``"auto"`` (the default) is resolved once, at construction, by [`resolve_planning()`][resolve_planning] from the
configuration alone; the resolved policy is what the fingerprint and the first-exchange check compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np

from .comm import MetadataExchange, PlanningGroups, Topology, planning_groups

__all__ = ["PLANNING_POLICIES", "PLANNING_CHOICES", "PlanningChoice", "MAX_PLANNING_GROUP", "default_planning_group",
           "resolve_planning", "check_planning", "PlanningSetup", "setup_planning"]

PLANNING_POLICIES = ("local", "global")
"""The policies a loader runs."""
PLANNING_CHOICES = ("auto", *PLANNING_POLICIES)
"""What ``planning=`` accepts: a policy, or ``"auto"`` (resolved by [`resolve_planning()`][resolve_planning])."""
PlanningChoice = Literal["auto", "local", "global"]

MAX_PLANNING_GROUP = 64
"""Default planning-group size cap: the per-round metadata exchange inside a group carries buffer_size x
(2 + extras) int64 per rank (4,096 x 2 x 8 B = 64 KiB), so each of k ranks receives k x 64 KiB a round."""

NODE_SIZE = 8
"""Planning-group size above [`MAX_PLANNING_GROUP`][MAX_PLANNING_GROUP] ranks: one node of 8 accelerators."""


def default_planning_group(world_size: int) -> int:
    """All ranks up to [`MAX_PLANNING_GROUP`][MAX_PLANNING_GROUP]; above, one node (8 ranks) when W is a multiple of 8,
    else 64.

    >>> default_planning_group(4), default_planning_group(2560), default_planning_group(100)
    (4, 8, 64)
    """
    if world_size <= MAX_PLANNING_GROUP:
        return max(world_size, 1)
    return NODE_SIZE if world_size % NODE_SIZE == 0 else MAX_PLANNING_GROUP


def resolve_planning(requested: str, world_size: int, *, balance: bool, planning_group: int | None) -> str:
    """The policy a loader runs: ``requested`` itself, or what ``"auto"`` stands for in this configuration.

    NOTE [ The default planning policy ]
        ``"auto"`` is ``"global"`` when all of these hold, else ``"local"``:

        * ``world_size >= 2`` -- one rank has no peer buffer to pool (global planning would only add
          exchanges);
        * ``world_size <= MAX_PLANNING_GROUP`` (64), or ``planning_group`` is given -- up to 64 ranks form one
          planning group, the setting global planning was measured in (chitchat x8 on 4 real gloo ranks:
          1.004x the global oracle's steps against local's 1.023x, per-step imbalance 1.003 against 1.080);
          above 64 the default groups and the two-level exchange are measured only in simulation and with
          <= 16 contended processes, so global planning there is an opt-in (``planning="global"``, or an
          explicit ``planning_group``);
        * ``balance=False`` -- ``balance=True`` asks for the local policy's step rebalancer; global planning
          subsumes it and the two are not combined (``planning="global", balance=True`` is refused).

        Only the configuration decides (never the data or the machine), so every rank with the same arguments
        resolves the same policy; a rank that resolves differently is refused at the first exchange
        ([`check_planning()`][check_planning]) naming both settings.

        What the default trains is part of the plan (evenflow.planning.pooled.mix): each optimizer
        step takes its micro-batches from different length strata, and each round emits a systematic sample
        of its groups in random order: the epoch runs in no length curriculum, and steps are more mixed than
        before on every measured row (H_g <= 1 against a random deal of the same micro-batches at W = 2;
        above 1 on most data sets at W = 4 and 8, README "What the default trains"). Measured in the demo's
        single-process replay (``benchmarks/training/quality_replay.py``, paired with random fixed batches of the same
        samples per step, held-out nats/token, 95 % CI): on chitchat the library default +0.036 [-0.005, +0.082] (32
        seeds), the older cost-ordered steps +0.104 and local +0.082 (16 seeds, sqrt LR rule); on
        hh-rlhf's short dialogues the default +0.018 [+0.009, +0.026] (8 seeds) -- what its two
        length-homogeneous micro-batches per step cost under AdamW, which two micro-batches per rank and step
        (``grad_accum_steps=2``, half the budget) take away. Check held-out quality, not only throughput, when
        you switch.

    >>> [resolve_planning("auto", w, balance=False, planning_group=None) for w in (1, 2, 64, 65)]
    ['local', 'global', 'global', 'local']
    >>> resolve_planning("auto", 4, balance=True, planning_group=None), resolve_planning("local", 4, balance=False,
    ...                                                                                   planning_group=None)
    ('local', 'local')
    """
    if requested != "auto":
        return requested
    scale_ok = world_size <= MAX_PLANNING_GROUP or planning_group is not None
    return "global" if world_size >= 2 and scale_ok and not balance else "local"


def check_planning(exchange: MetadataExchange, policy: str, group: int, requested: str | None = None) -> None:
    """The first exchange of every epoch: refuse peers whose planning differs, naming every setting.

    Every policy runs it (a ``"local"`` peer must take part, or it would meet a global peer's first
    planning exchange inside a different collective). ``requested``: what ``planning=`` said (``"auto"``
    is named beside the policy it resolved to); ranks are compared on the resolved policy and group.
    """
    asked = PLANNING_CHOICES.index(requested if requested is not None else policy)
    table = exchange.all_gather(np.array([PLANNING_POLICIES.index(policy), group, asked], dtype=np.int64))
    settings = sorted({(int(p), int(g)) for p, g, _ in table})
    if len(settings) > 1:
        def name(rank: int) -> str:
            p, g, a = (int(v) for v in table[rank])
            via = f" (planning={PLANNING_CHOICES[a]!r} resolved)" if PLANNING_CHOICES[a] == "auto" else ""
            return f"planning={PLANNING_POLICIES[p]!r}{via} planning_group={g}"

        by_setting: dict[str, list[int]] = {}
        for rank in range(len(table)):
            by_setting.setdefault(name(rank), []).append(rank)
        raise ValueError(f"ranks disagree on the planning configuration (setting -> ranks: {by_setting}); build "
                         "every rank's loader with the same planning=, planning_group= and balance= (planning="
                         "'auto' resolves from the world size, balance= and planning_group=, NOTE [ The default "
                         "planning policy ] in evenflow/runtime/planning.py)")


@dataclass(frozen=True)
class PlanningSetup:
    policy: str
    """The policy this loader runs (``"local"`` or ``"global"``; ``"auto"`` already resolved)."""
    size: int
    """Ranks per planning group (resolved; recorded for ``"local"`` too, so the check compares like with like)."""
    groups: PlanningGroups | None
    """The planning groups (``"global"`` only)."""
    exchange: MetadataExchange
    """The loader's world-wide metadata exchange: two-level when there is more than one planning group."""
    requested: str
    """What ``planning=`` said (``"auto"`` or the policy itself); named by the check's error."""

    def check(self) -> None:
        check_planning(self.exchange, self.policy, self.size, self.requested)


def setup_planning(requested: str, group: int | None, topology: Topology, timeout: timedelta, *,
                   balance: bool) -> PlanningSetup:
    """Resolve the policy ([`resolve_planning()`][resolve_planning]) and its groups; collective over the metadata group
    when
    the policy is ``"global"`` with more than one group."""
    world = topology.world_size
    policy = resolve_planning(requested, world, balance=balance, planning_group=group)
    size = default_planning_group(world) if group is None else group
    if size > world:
        raise ValueError(f"planning_group={size} exceeds the world size {world}; pass planning_group <= {world} "
                         "(or None for the default)")
    exchange = MetadataExchange(topology)
    if policy != "global":
        return PlanningSetup(policy, size, None, exchange, requested)
    from . import global_round  # noqa: F401 - warm the import (scipy) here, not in the first round
    from .comm import TwoLevelExchange
    if world > 1:
        # Before any planning group is created: ranks that disagree on planning_group would each call new_group
        # with other members and stall until the timeout ("Wait timeout", naming nothing). A rank that resolved
        # "local" meets this exchange with its own first-epoch check (the same all_gather), and refuses too.
        check_planning(exchange, policy, size, requested)
    groups = planning_groups(topology, size, timeout)
    if len(groups.starts) > 1:
        exchange = TwoLevelExchange(topology, groups)
    return PlanningSetup(policy, size, groups, exchange, requested)
