"""Length profile of a data set after its pipeline, and a token budget recommendation.

``length_profile`` summarizes realized lengths; ``recommend_budget`` turns a memory model ("this many padded
tokens fit in one batch") into a ``token_budget`` and predicts, with the same planner the loader runs
([`evenflow.plan_groups()`][evenflow.plan_groups]), how well dynamic batches fill it compared with the fixed batch size
a user would pick to avoid running out of memory (the largest one whose batches of the longest sample still fit).

Padded efficiency = real tokens / (samples x longest sample), summed over batches. Budget utilization = real
tokens per batch / token budget: how much of the memory each step actually uses. Example, budget 4096,
lengths [4096, 100, 100, ...]: fixed batch size 1 has padded efficiency 1.0 but uses ~2.4 % of the budget on
a 100-token step; a dynamic batch of 40 such samples uses ~98 %.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..planning.grouping import plan_groups

__all__ = ["LengthProfile", "BudgetAdvice", "length_profile", "recommend_budget", "plot_lengths"]

DEFAULT_PLAN_WINDOW = 512
"""Samples per simulated planning window: the loader plans within a bounded buffer, not the whole epoch, so
predicting from windows of shuffled samples avoids promising the whole-data-set optimum."""


@dataclass(frozen=True)
class LengthProfile:
    """Realized lengths (tokens, after truncation) of one data set."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: int
    cv: float
    """Coefficient of variation, std / mean: ODB's gains grow with it."""
    short_threshold: int
    short_fraction: float
    """Fraction of samples with at most ``short_threshold`` tokens."""
    cutoff: int | None
    over_cutoff: int
    """Samples whose untruncated length exceeded ``cutoff`` (they were truncated)."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class BudgetAdvice:
    """A token budget for a memory model and what to expect from it."""

    memory_tokens: int
    token_budget: int
    too_long: int
    """Samples longer than the memory model allows: they need a cutoff <= token_budget (or oversize policy)."""
    fixed_batch_size: int
    fixed_padded_efficiency: float
    fixed_utilization: float
    fixed_steps: int
    dynamic_padded_efficiency: float
    dynamic_utilization: float
    dynamic_steps: int
    dynamic_mean_batch_size: float
    world_size: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def length_profile(raw_lengths: Sequence[int] | np.ndarray, *, cutoff: int | None = None,
                   short_threshold: int | None = None) -> LengthProfile:
    """Profile of ``min(raw, cutoff)`` (what a prefix-truncating pipeline yields).

    ``short_threshold`` defaults to 1/16 of the cutoff (256 for 4096) or, without a cutoff, of the longest
    sample.

    >>> p = length_profile([10, 20, 30, 5000], cutoff=4096)
    >>> p.max, p.over_cutoff, p.short_threshold, p.short_fraction
    (4096, 1, 256, 0.75)
    """
    raw = np.asarray(raw_lengths, dtype=np.int64)
    if raw.size == 0:
        raise ValueError("no samples to profile")
    lengths = np.minimum(raw, cutoff) if cutoff is not None else raw
    if short_threshold is None:
        short_threshold = max(1, (cutoff if cutoff is not None else int(lengths.max())) // 16)
    mean = float(lengths.mean())
    return LengthProfile(count=int(lengths.size), mean=mean, median=float(np.median(lengths)),
                         p90=float(np.percentile(lengths, 90)), p99=float(np.percentile(lengths, 99)),
                         max=int(lengths.max()), cv=float(lengths.std() / mean) if mean else 0.0,
                         short_threshold=int(short_threshold),
                         short_fraction=float(np.mean(lengths <= short_threshold)), cutoff=cutoff,
                         over_cutoff=int(np.sum(raw > cutoff)) if cutoff is not None else 0)


def recommend_budget(lengths: Sequence[int] | np.ndarray, *, memory_tokens: int, world_size: int = 1,
                     window: int = DEFAULT_PLAN_WINDOW, seed: int = 0) -> BudgetAdvice:
    """Budget = the padded tokens that fit (``memory_tokens``; the padded cost is what memory holds).

    Samples longer than that are counted in ``too_long`` and predicted as if cut to the budget. Steps are
    per rank (``world_size`` ranks share the batches).

    >>> a = recommend_budget([4096] + [100] * 399, memory_tokens=4096, window=400)
    >>> a.fixed_batch_size, a.fixed_steps, a.dynamic_steps
    (1, 400, 11)
    """
    if isinstance(memory_tokens, bool) or not isinstance(memory_tokens, (int, np.integer)) or memory_tokens <= 0:
        raise ValueError(f"memory_tokens must be a positive integer (padded tokens that fit in one batch), "
                         f"got {memory_tokens!r}")
    if world_size < 1 or window < 1:
        raise ValueError(f"world_size and window must be >= 1, got {world_size}, {window}")
    raw = np.asarray(lengths, dtype=np.int64)
    if raw.size == 0:
        raise ValueError("no samples to plan")
    budget = int(memory_tokens)
    clipped = np.minimum(raw, budget)
    order = np.random.default_rng(seed).permutation(raw.size)
    real = int(clipped.sum())

    batch_size = max(1, budget // int(clipped.max()))
    fixed_padded = sum(len(b) * int(clipped[b].max()) for b in _chunks(order, batch_size))
    fixed_batches = math.ceil(raw.size / batch_size)

    groups: list[np.ndarray] = []
    for win in _chunks(order, window):
        groups += [win[np.asarray(g)] for g in plan_groups(clipped[win], token_budget=budget)]
    dyn_padded = sum(len(g) * int(clipped[g].max()) for g in groups)
    return BudgetAdvice(memory_tokens=budget, token_budget=budget, too_long=int(np.sum(raw > budget)),
                        fixed_batch_size=batch_size, fixed_padded_efficiency=real / fixed_padded,
                        fixed_utilization=real / (fixed_batches * budget),
                        fixed_steps=math.ceil(fixed_batches / world_size),
                        dynamic_padded_efficiency=real / dyn_padded,
                        dynamic_utilization=real / (len(groups) * budget),
                        dynamic_steps=math.ceil(len(groups) / world_size),
                        dynamic_mean_batch_size=raw.size / len(groups), world_size=world_size)


def _chunks(order: np.ndarray, size: int) -> list[np.ndarray]:
    return [order[i:i + size] for i in range(0, len(order), size)]


def plot_lengths(lengths: Sequence[int] | np.ndarray, path: str, *, title: str, cutoff: int | None = None,
                 token_budget: int | None = None) -> None:
    """Histogram of lengths (log-spaced bins) with the cutoff and budget marked; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arr = np.asarray(lengths, dtype=np.int64)
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.geomspace(max(1, arr.min()), max(2, arr.max()) + 1, 50)
    ax.hist(arr, bins=bins, color="#4477aa")
    ax.set_xscale("log")
    ax.set_xlabel("realized length (tokens, after the pipeline)")
    ax.set_ylabel("samples")
    ax.set_title(title)
    if cutoff is not None:
        ax.axvline(cutoff, color="#cc6677", linestyle="--", label=f"cutoff {cutoff}")
    if token_budget is not None and token_budget != cutoff:
        ax.axvline(token_budget, color="#228833", linestyle=":", label=f"token budget {token_budget}")
    if cutoff is not None or token_budget is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
