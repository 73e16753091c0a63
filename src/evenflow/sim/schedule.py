"""A schedule says which rank trains which sample at which step -- the common currency of every policy.

A [`Schedule`][Schedule] is flat: one row per scheduled sample, ``(step, rank, sample)``. Steps are 0-based and
every rank runs every step (a rank with no row at a step is IDLE there). Example, W = 2:

    step 0: rank 0 trains samples [4, 1], rank 1 trains [0]
    step 1: rank 0 trains [2],            rank 1 is IDLE
    -> step = [0, 0, 0, 1], rank = [0, 0, 1, 0], sample = [4, 1, 0, 2], num_steps = 2

Baselines (benchmarks/baselines.py) and evenflow's own planners ([`evenflow.sim.policies`][evenflow.sim.policies]) all
produce one, and [`evenflow.sim.simulate()`][evenflow.sim.simulate] turns it into time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .costs import Layout

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """Who trains what, when. Arrays are int64 and of equal length."""

    world_size: int
    num_steps: int
    step: np.ndarray
    rank: np.ndarray
    sample: np.ndarray
    layout: Layout = "padded"
    """How each batch is collated: ``"padded"`` rows or one ``"summed"`` (varlen) row."""
    name: str = ""
    info: dict = field(default_factory=dict, compare=False)
    """Policy-specific counters (dropped samples, over-budget batches, rounds, ...)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not (len(self.step) == len(self.rank) == len(self.sample)):
            raise ValueError("step, rank and sample must have the same length")
        if len(self.step) and (self.step.min() < 0 or self.step.max() >= self.num_steps):
            raise ValueError(f"steps must lie in [0, {self.num_steps}), got [{self.step.min()}, {self.step.max()}]")
        if len(self.rank) and (self.rank.min() < 0 or self.rank.max() >= self.world_size):
            raise ValueError(f"ranks must lie in [0, {self.world_size})")

    @classmethod
    def from_steps(cls, steps: Sequence[Sequence[Sequence[int]]], world_size: int, *, layout: Layout = "padded",
                   name: str = "", info: dict | None = None) -> Schedule:
        """Build from ``steps[s][r] = list of sample ids`` (an empty list, or a missing rank, is IDLE)."""
        st, rk, sm = [], [], []
        for s, per_rank in enumerate(steps):
            if len(per_rank) > world_size:
                raise ValueError(f"step {s} has {len(per_rank)} ranks, world_size is {world_size}")
            for r, members in enumerate(per_rank):
                st.extend([s] * len(members))
                rk.extend([r] * len(members))
                sm.extend(int(m) for m in members)
        return cls(world_size, len(steps), np.asarray(st, dtype=np.int64), np.asarray(rk, dtype=np.int64),
                   np.asarray(sm, dtype=np.int64), layout, name, dict(info or {}))

    @classmethod
    def from_rank_batches(cls, batches: Sequence[Sequence[Sequence[int]]], *, layout: Layout = "padded",
                          name: str = "", info: dict | None = None) -> Schedule:
        """Build from per-rank batch lists: ``batches[r][k]`` is rank r's k-th batch (paired by position, as
        DDP pairs them). Ranks with fewer batches are IDLE at the end."""
        world = len(batches)
        num_steps = max((len(b) for b in batches), default=0)
        steps = [[batches[r][k] if k < len(batches[r]) else [] for r in range(world)] for k in range(num_steps)]
        return cls.from_steps(steps, world, layout=layout, name=name, info=info)

    # -- views ---------------------------------------------------------------------------------------------
    def cell(self) -> np.ndarray:
        """Flat (step, rank) index of each row: ``step * world_size + rank``."""
        return self.step * self.world_size + self.rank

    def batches(self) -> list[list[list[int]]]:
        """``out[s][r]``: sample ids of rank r at step s, in schedule order."""
        out = [[[] for _ in range(self.world_size)] for _ in range(self.num_steps)]
        for s, r, i in zip(self.step.tolist(), self.rank.tolist(), self.sample.tolist()):
            out[s][r].append(i)
        return out

    def coverage(self, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        """``(missing, duplicated)`` sample ids among ``0..num_samples-1``."""
        counts = np.bincount(self.sample, minlength=num_samples)
        return np.flatnonzero(counts == 0), np.flatnonzero(counts > 1)

    def check_exactly_once(self, num_samples: int) -> None:
        """Raise unless every sample ``0..num_samples-1`` is scheduled exactly once."""
        missing, dup = self.coverage(num_samples)
        if len(missing) or len(dup) or (len(self.sample) and self.sample.max() >= num_samples):
            raise AssertionError(f"{self.name or 'schedule'}: {len(missing)} samples missing "
                                 f"(e.g. {missing[:5].tolist()}), {len(dup)} duplicated (e.g. {dup[:5].tolist()})")
