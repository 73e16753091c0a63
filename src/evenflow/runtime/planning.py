"""Which planning policy a loader runs, its planning groups, and the check that every rank agrees on both.

Light on purpose: every loader imports this; only ``planning="global"`` imports evenflow.runtime.global_round
(and scipy), at construction, so the first round does not stall on an import.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np

from .comm import MetadataExchange, PlanningGroups, Topology, planning_groups

__all__ = ["PLANNING_POLICIES", "MAX_PLANNING_GROUP", "default_planning_group", "check_planning", "PlanningSetup",
           "setup_planning"]

PLANNING_POLICIES = ("local", "global")

MAX_PLANNING_GROUP = 64
"""Default planning-group size cap: the per-round metadata exchange inside a group carries buffer_size x
(2 + extras) int64 per rank (4,096 x 2 x 8 B = 64 KiB), so each of k ranks receives k x 64 KiB a round."""

NODE_SIZE = 8
"""Planning-group size above :data:`MAX_PLANNING_GROUP` ranks: one node of 8 accelerators."""


def default_planning_group(world_size: int) -> int:
    """All ranks up to :data:`MAX_PLANNING_GROUP`; above, one node (8 ranks) when W is a multiple of 8, else 64.

    >>> default_planning_group(4), default_planning_group(2560), default_planning_group(100)
    (4, 8, 64)
    """
    if world_size <= MAX_PLANNING_GROUP:
        return max(world_size, 1)
    return NODE_SIZE if world_size % NODE_SIZE == 0 else MAX_PLANNING_GROUP


def check_planning(exchange: MetadataExchange, policy: str, group: int) -> None:
    """The first exchange of every epoch: refuse peers whose planning differs, naming every setting.

    Every policy runs it (a ``"local"`` peer must take part, or it would meet a global peer's first
    planning exchange inside a different collective).
    """
    table = exchange.all_gather(np.array([PLANNING_POLICIES.index(policy), group], dtype=np.int64))
    settings = sorted({(int(p), int(g)) for p, g in table})
    if len(settings) > 1:
        by_setting = {f"planning={PLANNING_POLICIES[p]!r} planning_group={g}":
                      [r for r in range(len(table)) if (int(table[r, 0]), int(table[r, 1])) == (p, g)]
                      for p, g in settings}
        raise ValueError(f"ranks disagree on the planning configuration (setting -> ranks: {by_setting}); build "
                         "every rank's loader with the same planning= and planning_group=")


@dataclass(frozen=True)
class PlanningSetup:
    policy: str
    size: int
    """Ranks per planning group (resolved; recorded for ``"local"`` too, so the check compares like with like)."""
    groups: PlanningGroups | None
    """The planning groups (``"global"`` only)."""
    exchange: MetadataExchange
    """The loader's world-wide metadata exchange: two-level when there is more than one planning group."""

    def check(self) -> None:
        check_planning(self.exchange, self.policy, self.size)


def setup_planning(policy: str, group: int | None, topology: Topology, timeout: timedelta) -> PlanningSetup:
    """Resolve the policy's groups; collective over the metadata group when there is more than one group."""
    world = topology.world_size
    size = default_planning_group(world) if group is None else group
    if size > world:
        raise ValueError(f"planning_group={size} exceeds the world size {world}; pass planning_group <= {world} "
                         "(or None for the default)")
    exchange = MetadataExchange(topology)
    if policy != "global":
        return PlanningSetup(policy, size, None, exchange)
    from . import global_round  # noqa: F401 - warm the import (scipy) here, not in the first round
    from .comm import TwoLevelExchange
    groups = planning_groups(topology, size, timeout)
    if len(groups.starts) > 1:
        exchange = TwoLevelExchange(topology, groups)
    return PlanningSetup(policy, size, groups, exchange)
