"""Time, not tokens: the per-item cost ``f(L) = gamma + alpha L + beta L^2`` a planner balances. Pure numpy.

Token budgets stay hard constraints (a group never exceeds them); the *time* cost decides which groups
share a step and how items are balanced across ranks. A :class:`TimeCost` is fixed before the epoch
(passed in, or fitted from profiling on rank 0 and broadcast), stored in the loader state and compared
across ranks through :meth:`TimeCost.key` -- never refit mid-epoch, so batches stay a function of seed,
configuration, world size and data.

NOTE [ Scoring time balance honestly ]
    A planner that balances on its own coefficients and is then scored with the same coefficients always
    looks perfect. Benchmarks score with a *separately* fitted model (another calibration split, or measured
    step times): :func:`evenflow.sim.timefit.fit_time_cost` fits the planner's coefficients to noisy timings
    on a calibration split of lengths, and the simulator scores with its own cost model.

Example, one phase, ``alpha = 1, beta = 1e-4`` (attention matters from ~10k tokens): a padded group of
4 rows of 1,000 tokens costs ``4 * (1000 + 100) = 4400``; one row of 4,000 tokens costs
``4000 + 1600 = 5600`` -- equal padded tokens, 27 % more time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..quadratic import QuadraticCost

__all__ = ["PhaseTime", "TimeCost", "TOKENS"]

TOKENS = "tokens"
"""Length key of the LLM phase: the sample's token count (other phases name an ``extra`` resource)."""


@dataclass(frozen=True, kw_only=True)
class PhaseTime(QuadraticCost):
    """One phase's per-item cost: a :class:`QuadraticCost` on the per-sample length named ``length_key``."""

    length_key: str = TOKENS
    """``"tokens"`` for the LLM, or the name of an extra per-sample resource (e.g. ``"patches"``)."""


@dataclass(frozen=True, kw_only=True)
class TimeCost:
    """Per-phase item costs; a group's time is the sum over phases (phases run one after another).

    ``TimeCost()`` counts tokens (one phase, ``alpha = 1``), which reproduces token balancing.

    >>> tc = TimeCost(phases=(PhaseTime(alpha=1.0, beta=1e-4),))
    >>> tc.group_times({"tokens": np.array([1000, 1000, 1000, 1000, 4000])}, np.array([0, 0, 0, 0, 1]), 2).tolist()
    [4400.0, 5600.0]
    """

    phases: tuple[PhaseTime, ...] = (PhaseTime(),)
    layout: Literal["padded", "summed"] = "padded"
    """``"padded"``: a group of n items costs ``n * f(max L)`` per phase; ``"summed"``: ``sum f(L)``."""
    source: str = ""
    """Where the coefficients come from (fit split, datasheet) -- part of the key, so ranks that fitted on
    different data refuse each other."""

    def __post_init__(self) -> None:
        if not self.phases or not all(isinstance(p, PhaseTime) for p in self.phases):
            raise ValueError(f"TimeCost.phases must be a non-empty tuple of PhaseTime, got {self.phases!r}")
        if self.layout not in ("padded", "summed"):
            raise ValueError(f"TimeCost.layout must be 'padded' or 'summed', got {self.layout!r}")

    @property
    def length_keys(self) -> tuple[str, ...]:
        return tuple(p.length_key for p in self.phases)

    def key(self) -> tuple:
        """Exact, comparable identity (floats by ``float.hex``): equal on two ranks iff the models are."""
        return (self.layout, self.source) + tuple(
            (p.length_key, float(p.gamma).hex(), float(p.alpha).hex(), float(p.beta).hex()) for p in self.phases)

    def group_times(self, lengths: Mapping[str, np.ndarray], group: np.ndarray, num_groups: int) -> np.ndarray:
        """Time of each group ``0..num_groups-1``; ``group[i]`` is item i's group. Items with a phase length
        of 0 (no image) add nothing to that phase, and a group without any costs 0 there."""
        out = np.zeros(num_groups, dtype=np.float64)
        for phase in self.phases:
            if phase.length_key not in lengths:
                raise ValueError(f"TimeCost phase needs per-item lengths {phase.length_key!r}; pass them in extra="
                                 f"{{{phase.length_key!r}: ...}} or drop the phase")
            ls = np.asarray(lengths[phase.length_key], dtype=np.int64)
            active = ls > 0
            count = np.bincount(group[active], minlength=num_groups).astype(np.float64)
            if self.layout == "padded":
                longest = np.zeros(num_groups, dtype=np.int64)
                np.maximum.at(longest, group[active], ls[active])
                work = count * phase(longest)
            else:
                work = np.bincount(group[active], weights=phase(ls[active]), minlength=num_groups)
            out += np.where(count > 0, work, 0.0)
        return out
