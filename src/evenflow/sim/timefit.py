"""The planner's time cost, fitted on its own calibration split -- never the scorer's coefficients.

NOTE [ Scoring time balance honestly ] (evenflow.planning.timecost) asks for a planner model fitted
separately from the one that scores it. In the simulator the scorer is a [`CostModel`][evenflow.sim.CostModel]
(FLOP-derived, or fitted to CPU timings); the planner gets [`fit_time_cost()`][fit_time_cost]: "measured" single-row
batch times on a calibration split of lengths -- the scorer's prediction times lognormal noise (default
3 %, about run-to-run jitter of a GPU step) -- fitted by
[`evenflow.balance.fit_quadratic()`][evenflow.balance.fit_quadratic]. The fit never sees the samples it later plans
(pass a split disjoint from the epoch) nor the scorer's per-batch and per-step constants (a planner cannot observe them
per item).
"""

from __future__ import annotations

import numpy as np

from ..planning.timecost import PhaseTime, TimeCost
from .costs import CostModel

__all__ = ["fit_time_cost", "CALIBRATION_POINTS", "CALIBRATION_NOISE"]

CALIBRATION_POINTS = 48
"""Lengths timed per phase (a few minutes of profiling on a real cluster)."""
CALIBRATION_NOISE = 0.03
"""Relative noise (sigma of a lognormal factor) on each simulated timing."""


def fit_time_cost(model: CostModel, calibration_lengths: np.ndarray, *, seed: int = 0,
                  noise: float = CALIBRATION_NOISE, points: int = CALIBRATION_POINTS) -> TimeCost:
    """A single-phase (tokens) [`TimeCost`][TimeCost] fitted to noisy timings of ``model`` on a calibration split.

    >>> from evenflow.sim import CostModel, PhaseCost
    >>> m = CostModel(phases=(PhaseCost(per_token=2e-6, per_token_sq=1e-10),))
    >>> tc = fit_time_cost(m, np.arange(100, 9000, 7), noise=0.0)
    >>> round(tc.phases[0].alpha / 2e-6, 6), round(tc.phases[0].beta / 1e-10, 6)
    (1.0, 1.0)
    """
    from ..balance.costs import fit_quadratic  # pure numpy; imported here to keep sim importable alone

    lengths = np.asarray(calibration_lengths, dtype=np.int64)
    if lengths.size < 3:
        raise ValueError(f"fit_time_cost needs a calibration split of >= 3 lengths, got {lengths.size}")
    rng = np.random.default_rng([seed, 7919])
    picked = np.quantile(lengths, np.linspace(0.0, 1.0, points), method="nearest")
    phase = model.phases[0]
    measured = phase.sample_cost(picked) * np.exp(rng.normal(0.0, noise, picked.size)) if noise else \
        phase.sample_cost(picked)
    fit = fit_quadratic(picked, measured)
    return TimeCost(phases=(PhaseTime(gamma=fit.gamma, alpha=fit.alpha, beta=fit.beta),),
                    source=f"fit to {model.source or 'cost model'} on {points} calibration lengths, "
                           f"noise {noise:g}, seed {seed}")
