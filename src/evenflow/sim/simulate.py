"""Turn a [`Schedule`][Schedule] into time with a [`CostModel`][CostModel] (NOTE [ Step time ] in costs.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .costs import CostModel, rank_costs
from .schedule import Schedule

__all__ = ["SimResult", "simulate", "as_lengths"]


@dataclass(frozen=True)
class SimResult:
    """What a schedule costs. Per-step arrays have one entry per step."""

    name: str
    world_size: int
    steps: int
    samples: int
    real_tokens: int
    padded_tokens: int
    """Tokens the collated batches hold (padded layout: rows x longest; summed layout: real tokens)."""
    max_batch_tokens: int
    """Largest padded (or summed) token count of any single batch -- compare with the budget."""
    step_times: np.ndarray
    rank_load: np.ndarray
    """``[steps, world_size]`` seconds each rank computes at each step (all phases, no step overhead)."""

    @property
    def total_time(self) -> float:
        return float(self.step_times.sum())

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.total_time if self.total_time else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.total_time if self.total_time else 0.0

    @property
    def padded_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    @property
    def step_imbalance(self) -> np.ndarray:
        """Per step: max over ranks / mean over all ranks of compute load (1.0 = perfectly even)."""
        mean = self.rank_load.mean(axis=1)
        peak = self.rank_load.max(axis=1)
        return np.divide(peak, mean, out=np.ones_like(peak), where=mean > 0)

    @property
    def mean_imbalance(self) -> float:
        return float(self.step_imbalance.mean()) if self.steps else 1.0

    @property
    def load_efficiency(self) -> float:
        """sum_s mean_r load / sum_s max_r load: the fraction of rank-time spent computing (1.0 = no waiting)."""
        peak = self.rank_load.max(axis=1).sum() if self.steps else 0.0
        return float(self.rank_load.mean(axis=1).sum() / peak) if peak else 1.0

    def summary(self) -> dict:
        imb = self.step_imbalance
        return {
            "name": self.name, "world_size": self.world_size, "steps": self.steps, "samples": self.samples,
            "time_s": self.total_time, "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
            "padded_efficiency": self.padded_efficiency, "mean_imbalance": self.mean_imbalance,
            "p95_imbalance": float(np.percentile(imb, 95)) if self.steps else 1.0,
            "load_efficiency": self.load_efficiency, "max_batch_tokens": self.max_batch_tokens,
        }


def as_lengths(lengths: Mapping[str, np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
    """Normalize to ``{"tokens": ..., other phase lengths...}`` of int64 arrays."""
    if isinstance(lengths, Mapping):
        out = {k: np.asarray(v, dtype=np.int64) for k, v in lengths.items()}
    else:
        out = {"tokens": np.asarray(lengths, dtype=np.int64)}
    if "tokens" not in out:
        raise ValueError("lengths must include 'tokens' (the LLM sequence length of each sample)")
    return out


def simulate(schedule: Schedule, lengths: Mapping[str, np.ndarray] | np.ndarray, model: CostModel) -> SimResult:
    """Step times of ``schedule`` under ``model``. ``lengths[key][i]`` is sample i's length for a phase.

    >>> from evenflow.sim import CostModel, PhaseCost, Schedule
    >>> sched = Schedule.from_steps([[[0, 1], [2]]], world_size=2)
    >>> r = simulate(sched, [100, 300, 200], CostModel(phases=(PhaseCost(per_token=1e-3),)))
    >>> round(r.total_time, 3), round(r.mean_imbalance, 3)
    (0.6, 1.5)
    """
    lens = as_lengths(lengths)
    cells = schedule.num_steps * schedule.world_size
    cell = schedule.cell()
    load = np.zeros(cells, dtype=np.float64)
    step_time = np.full(schedule.num_steps, model.step_overhead, dtype=np.float64)
    for phase in model.phases:
        if phase.length_key not in lens:
            raise ValueError(f"phase {phase.name!r} needs lengths[{phase.length_key!r}]")
        cost = rank_costs(phase, lens[phase.length_key][schedule.sample], cell, cells, schedule.layout,
                          model.pad_to_multiple_of)
        load += cost
        if schedule.num_steps:
            step_time += cost.reshape(schedule.num_steps, schedule.world_size).max(axis=1)
    tok = lens["tokens"][schedule.sample]
    count = np.bincount(cell, minlength=cells)
    if schedule.layout == "padded":
        longest = np.zeros(cells, dtype=np.int64)
        np.maximum.at(longest, cell, tok)
        if model.pad_to_multiple_of and model.pad_to_multiple_of > 1:
            longest = -(-longest // model.pad_to_multiple_of) * model.pad_to_multiple_of
        batch_tokens = count * longest
    else:
        batch_tokens = np.bincount(cell, weights=tok, minlength=cells).astype(np.int64)
    return SimResult(
        name=schedule.name, world_size=schedule.world_size, steps=schedule.num_steps,
        samples=int(len(schedule.sample)), real_tokens=int(tok.sum()), padded_tokens=int(batch_tokens.sum()),
        max_batch_tokens=int(batch_tokens.max()) if cells else 0, step_times=step_time,
        rank_load=load.reshape(schedule.num_steps, schedule.world_size))
