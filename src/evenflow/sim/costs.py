"""Per-phase step-time model: what a batch costs on one rank, and what a step costs on W ranks.

NOTE [ Step time ]
    A training step runs its phases in order (vision encoder, then the LLM, ...), and every phase ends in a
    collective, so each phase lasts as long as its slowest rank:

        step_time = step_overhead + sum over phases p of  max over ranks r of  cost_p(batch of r)

    A rank's phase cost depends on how its batch is laid out:

    * ``"padded"`` (right-padding collate): every row is as long as the longest one, so the rank computes
      ``n`` copies of the longest sample:  ``per_batch + n * f(max L)``.
    * ``"summed"`` (padding-free / varlen attention): each sequence costs its own ``f(L)``:
      ``per_batch + sum f(L_i)``.

    with ``f(L) = per_sample + per_token * L + per_token_sq * L**2`` (OrchMLLM's ``gamma + alpha L + beta L^2``).
    A rank with nothing to do costs 0. Example, one phase, f(L) = 1e-3 L, W = 2, padded:
    rank 0 holds [100, 300] -> 2 * 0.3 = 0.6 s; rank 1 holds [200] -> 0.2 s; step = 0.6 s, imbalance 0.6/0.4.

``per_batch`` is the fixed cost of running a (non-empty) micro-batch at all: kernel launches, Python. The
``step_overhead`` is paid once per step by everyone: optimizer, gradient reduce-scatter/all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["Layout", "PhaseCost", "CostModel", "rank_costs"]

Layout = Literal["padded", "summed"]


@dataclass(frozen=True, kw_only=True)
class PhaseCost:
    """Seconds one rank spends in one phase. All coefficients are >= 0."""

    name: str = "llm"
    """Phase name, e.g. ``"llm"`` or ``"vision"``."""
    length_key: str = "tokens"
    """Which per-sample length drives this phase (a key of the lengths mapping given to the simulator)."""
    per_batch: float = 0.0
    """Fixed seconds per non-empty micro-batch (launch overhead)."""
    per_sample: float = 0.0
    """gamma: seconds per sample (row)."""
    per_token: float = 0.0
    """alpha: seconds per token (dense matmuls: about 6 x parameters FLOPs per token in training)."""
    per_token_sq: float = 0.0
    """beta: seconds per squared token of one sequence (attention scores)."""

    def __post_init__(self) -> None:
        for name in ("per_batch", "per_sample", "per_token", "per_token_sq"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"PhaseCost.{name} must be a finite number >= 0, got {value!r}")

    def sample_cost(self, lengths: np.ndarray) -> np.ndarray:
        """``f(L) = per_sample + per_token * L + per_token_sq * L**2`` for each length (float64)."""
        ls = np.asarray(lengths, dtype=np.float64)
        return self.per_sample + self.per_token * ls + self.per_token_sq * ls * ls


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """A step-time model: phases run in sequence, each bounded by its slowest rank (NOTE [ Step time ])."""

    phases: tuple[PhaseCost, ...] = (PhaseCost(),)
    step_overhead: float = 0.0
    """Seconds per step paid once by every rank (optimizer step, gradient synchronization)."""
    pad_to_multiple_of: int | None = None
    """Padded layout rounds the longest length up to a multiple of this (as the collate does)."""
    source: str = ""
    """Where the numbers come from (measurement, datasheet, assumption), for the report."""
    meta: dict = field(default_factory=dict, compare=False)
    """Free-form provenance details (fit residuals, FLOP rates, model shape)."""

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("CostModel needs at least one phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ValueError(f"phase names must be unique, got {names}")
        if not np.isfinite(self.step_overhead) or self.step_overhead < 0:
            raise ValueError(f"step_overhead must be >= 0, got {self.step_overhead!r}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1 or None, got {self.pad_to_multiple_of!r}")

    def batch_time(self, lengths: dict[str, np.ndarray] | np.ndarray, layout: Layout = "padded") -> float:
        """Seconds one rank needs for one batch (all phases, no step overhead); 0 for an empty batch."""
        lens = lengths if isinstance(lengths, dict) else {"tokens": np.asarray(lengths)}
        n = len(next(iter(lens.values())))
        cell = np.zeros(n, dtype=np.int64)
        return float(sum(rank_costs(p, lens[p.length_key], cell, 1, layout, self.pad_to_multiple_of)[0]
                         for p in self.phases))


def rank_costs(phase: PhaseCost, lengths: np.ndarray, cell: np.ndarray, num_cells: int, layout: Layout,
               pad_to_multiple_of: int | None = None) -> np.ndarray:
    """Cost of ``phase`` in every cell (a cell is one (step, rank) batch). Vectorized over samples.

    ``lengths[i]`` is the phase length of the i-th scheduled sample and ``cell[i]`` the batch it is in.
    Samples with phase length 0 (e.g. no image for the vision phase) add nothing, and a cell with no
    positive-length sample costs 0 in this phase (its rank skips the encoder).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    active = lengths > 0
    count = np.bincount(cell[active], minlength=num_cells).astype(np.float64)
    if layout == "padded":
        longest = np.zeros(num_cells, dtype=np.int64)
        np.maximum.at(longest, cell[active], lengths[active])
        if pad_to_multiple_of and pad_to_multiple_of > 1:
            longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        work = count * phase.sample_cost(longest)
    elif layout == "summed":
        work = np.bincount(cell[active], weights=phase.sample_cost(lengths[active]), minlength=num_cells)
    else:
        raise ValueError(f"layout must be 'padded' or 'summed', got {layout!r}")
    return np.where(count > 0, work + phase.per_batch, 0.0)
