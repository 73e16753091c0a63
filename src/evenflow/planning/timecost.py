"""Time, not tokens: the per-item cost ``f(L) = gamma + alpha L + beta L^2`` a planner balances. Pure numpy.

Token budgets stay hard constraints (a group never exceeds them); the *time* cost decides which groups
share a step and how items are balanced across ranks. A [`TimeCost`][TimeCost] is fixed before the epoch
(passed in, or fitted from profiling on rank 0 and broadcast), stored in the loader state and compared
across ranks through [`TimeCost.key()`][TimeCost.key] -- never refit mid-epoch, so batches stay a function of seed,
configuration, world size and data.

NOTE [ Scoring time balance honestly ]
    A planner that balances on its own coefficients and is then scored with the same coefficients always
    looks perfect. Benchmarks score with a *separately* fitted model (another calibration split, or measured
    step times): `evenflow.sim.timefit.fit_time_cost()` fits the planner's coefficients to noisy timings
    on a calibration split of lengths, and the simulator scores with its own cost model.

Example, one phase, ``alpha = 1, beta = 1e-4`` (attention matters from ~10k tokens): a padded group of
4 rows of 1,000 tokens costs ``4 * (1000 + 100) = 4400``; one row of 4,000 tokens costs
``4000 + 1600 = 5600`` -- equal padded tokens, 27 % more time.

NOTE [ The default time cost ]
    What the loader balances when ``time_cost=None`` ([`default_time_cost()`][default_time_cost]):

    * ``cost="padded"``: [`TimeCost`][TimeCost] ``()``, padded tokens (a padded group's
      tokens already carry its longest row, and what the default trains was measured with it);
    * ``cost="summed"``: the attention-aware cost Megatron-LM and verl balance packs with, ``24576 L + L^2``
      (linear layers at hidden 4,096, ``6 * 4096`` per token, plus attention per sequence), divided by 24,576:
      ``f(L) = L + L^2 / 24,576``, summed over the sequences of a pack. A pack of one 16,384-token sequence then
      costs 1.67 times a pack of 16,384 tokens of short chats; by tokens they are equal.

    The ratio ``beta / alpha`` is all a plan depends on (time is compared, never added to a clock), so one
    number per model: [`TimeCost.from_model()`][TimeCost.from_model] counts it from a model's config (Qwen3-8B: ``1 /
    51,324``, NOTE [ GPU cost from FLOPs ] in evenflow/sim/calibrate.py), and a measured fit
    ([`evenflow.balance.fit_quadratic()`][evenflow.balance.fit_quadratic] over timed single sequences) gives gamma too.
    A rank's slowest sequence is the one that matters: a model with a larger ratio (longer context per parameter) needs
    its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..quadratic import QuadraticCost

__all__ = ["PhaseTime", "TimeCost", "TOKENS", "PACKED_HIDDEN", "default_time_cost"]

TOKENS = "tokens"
"""Length key of the LLM phase: the sample's token count (other phases name an ``extra`` resource)."""

PACKED_HIDDEN = 4096
"""Hidden size of the default packed cost (NOTE [ The default time cost ]): ``f(L) = 6 h L + L^2`` per sequence,
Megatron-LM's and verl's ``24576 L + L^2``."""


@dataclass(frozen=True, kw_only=True)
class PhaseTime(QuadraticCost):
    """One phase's per-item cost: a [`QuadraticCost`][QuadraticCost] on the per-sample length named ``length_key``."""

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

    @classmethod
    def from_model(cls, config: object, *, layout: Literal["padded", "summed"] = "summed") -> TimeCost:
        """The FLOP-count cost of a dense decoder from its config (a ``transformers`` config or its ``config.json``
        as a dict), per NOTE [ GPU cost from FLOPs ] in evenflow/sim/calibrate.py: ``6 N`` FLOPs per token for the
        ``N`` matmul parameters (LM head included) and ``6 * layers * heads * head_dim`` per squared token of
        one sequence (causal attention, forward and backward), divided by ``6 N`` (only the ratio plans).

        >>> qwen3_8b = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        ...                 head_dim=128, intermediate_size=12288, vocab_size=151936)
        >>> round(1 / TimeCost.from_model(qwen3_8b).phases[0].beta)
        51324
        """
        def read(name: str, default: object = None) -> int:
            value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"TimeCost.from_model needs a positive int {name!r} in the model config, got "
                                 f"{value!r}; pass a dense decoder's config (config.json), or build TimeCost("
                                 "phases=(PhaseTime(alpha=..., beta=...),)) from a measured fit")
            return int(value)

        layers, hidden, heads = read("num_hidden_layers"), read("hidden_size"), read("num_attention_heads")
        kv_heads, head_dim = read("num_key_value_heads", heads), read("head_dim", hidden // heads)
        per_layer = 2 * hidden * (heads + kv_heads) * head_dim + 3 * hidden * read("intermediate_size")
        matmul = layers * per_layer + read("vocab_size") * hidden
        name = type(config).__name__ if not isinstance(config, Mapping) else str(config.get("model_type", "model"))
        return cls(phases=(PhaseTime(alpha=1.0, beta=layers * heads * head_dim / matmul),), layout=layout,
                   source=f"FLOPs of {name} ({layers} layers, hidden {hidden}, {matmul / 1e9:.2f} B matmul params)")

    def describe(self) -> str:
        """One line for logs and ``evenflow profile``: each phase's ``f(L)`` and the layout."""
        def phase(p: PhaseTime) -> str:
            terms = [f"{p.gamma:.4g}"] if p.gamma else []
            terms += [("L" if p.alpha == 1 else f"{p.alpha:.4g} L")] if p.alpha else []
            if p.beta:
                terms.append(f"L^2 / {1 / p.beta:,.0f}" if p.alpha == 1 else f"{p.beta:.4g} L^2")
            return f"{p.length_key}: f(L) = {' + '.join(terms) or '0'}"
        text = f"{'; '.join(phase(p) for p in self.phases)} ({self.layout})"
        return text + (f", {self.source}" if self.source else "")

    def key(self) -> tuple:
        """Exact, comparable identity (floats by ``float.hex``): equal on two ranks iff the models are."""
        return (self.layout, self.source) + tuple(
            (p.length_key, float(p.gamma).hex(), float(p.alpha).hex(), float(p.beta).hex()) for p in self.phases)

    def item_times(self, lengths: Mapping[str, np.ndarray]) -> np.ndarray:
        """Each item's own time, summed over phases (a phase length of 0 adds nothing): what it adds to a
        ``"summed"`` group, whose time is the sum of its items'."""
        out = None
        for phase in self.phases:
            ls = np.asarray(lengths[phase.length_key], dtype=np.int64)
            t = np.where(ls > 0, phase(ls), 0.0)
            out = t if out is None else out + t
        return out

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


def default_time_cost(cost: Literal["padded", "summed"]) -> TimeCost:
    """The time cost a loader plans with when ``time_cost=None`` (NOTE [ The default time cost ]).

    >>> default_time_cost("padded") == TimeCost(), default_time_cost("summed").describe()
    (True, 'tokens: f(L) = L + L^2 / 24,576 (summed), 24576 L + L^2 (Megatron-LM, verl), divided by 24,576')
    """
    if cost == "padded":
        return TimeCost()
    return TimeCost(phases=(PhaseTime(alpha=1.0, beta=1.0 / (6 * PACKED_HIDDEN)),), layout="summed",
                    source=f"{6 * PACKED_HIDDEN} L + L^2 (Megatron-LM, verl), divided by {6 * PACKED_HIDDEN:,}")
