"""How [`evenflow.balance.plan_balance()`][evenflow.balance.plan_balance] balances: a frozen configuration, validated on
construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BalanceConfig", "Method", "Assignment", "BATCHED_ABOVE"]

Method = Literal["auto", "lpt", "lpt_batched", "kk", "milp"]
Assignment = Literal["greedy", "exact"]

BATCHED_ABOVE = 16_384
"""``method="auto"`` uses heap LPT up to this many items and batched LPT above (NOTE [ Batched LPT ])."""


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How [`plan_balance()`][plan_balance] balances. Every field is checked in ``__post_init__``."""

    method: Method = "auto"
    """``"auto"`` (heap LPT up to ``BATCHED_ABOVE`` items, batched LPT above), ``"lpt"``, ``"lpt_batched"``,
    ``"kk"`` (Karmarkar-Karp) or ``"milp"`` (exact, small instances)."""
    refine: bool = True
    """Run swap refinement after the greedy planners (never makes the max load worse)."""
    locality_tolerance: float | None = 0.02
    """Keep items on their source rank when that raises the max load by at most this fraction of the
    balanced plan's (NOTE [ Locality ]). ``None`` turns locality off: buckets are only mapped to ranks."""
    equal_counts: bool = False
    """Every rank gets ``n // R`` or ``n // R + 1`` items (e.g. when the items are groups and every rank must
    run the same number of micro-steps). Locality is skipped under this constraint."""
    node_assignment: bool = True
    """Map balanced buckets to ranks so that the fewest bytes move (``assignment`` says how). ``False``
    places bucket ``b`` on rank ``b``."""
    assignment: Assignment = "greedy"
    """``"greedy"``: sparse greedy matching on bytes already in place (NOTE [ Greedy bucket matching ]; ~ms at
    2,560 ranks, no scipy); ``"exact"``: linear assignment on the dense ``[buckets, ranks]`` byte matrix
    ([`assign_buckets()`][evenflow.balance.topology.assign_buckets]; ~1 s at 2,560 ranks, imports scipy)."""
    milp_time_limit: float = 10.0
    """Seconds HiGHS may spend in ``method="milp"``; the best solution found is used after that."""

    def __post_init__(self) -> None:
        if self.method not in ("auto", "lpt", "lpt_batched", "kk", "milp"):
            raise ValueError(f"method must be 'auto', 'lpt', 'lpt_batched', 'kk' or 'milp', got {self.method!r}")
        if self.locality_tolerance is not None and not (
                isinstance(self.locality_tolerance, (int, float)) and 0 <= self.locality_tolerance < 1):
            raise ValueError(f"locality_tolerance must be a fraction in [0, 1) or None (off), got "
                             f"{self.locality_tolerance!r}")
        if self.assignment not in ("greedy", "exact"):
            raise ValueError(f"assignment must be 'greedy' or 'exact', got {self.assignment!r}")
        if not (isinstance(self.milp_time_limit, (int, float)) and self.milp_time_limit > 0):
            raise ValueError(f"milp_time_limit must be > 0 seconds, got {self.milp_time_limit!r}")
