"""What an epoch's optimizer steps are made of: length mix and length order, against random batching.

A planner that forms tight, length-homogeneous micro-batches should still make each *optimizer step* mix
lengths and not order the epoch like a curriculum. Six numbers say whether it does, for any
`Schedule`. They describe the plan; what it trains is measured by training (the quality replay among the
training benchmarks), and H alone does not predict it (the page "What the default trains"):

* ``m_s`` -- the token-weighted mean of ``log(length)`` over the samples of optimizer step ``s`` (every rank,
  every micro-batch of the accumulation window; optimizer step = loader step // ``grad_accum_steps``; IDLE
  slots hold no sample and steps without samples are left out).
* **H** = ``Var_s(m_s)`` / the same variance for *random steps of the same sizes* (the epoch's samples
  permuted into the same per-step sample counts; mean over 64 permutations, seed 0). Random batching: ~1.
* **H_g** = ``Var_s(m_s)`` / the same variance when the schedule's own non-empty micro-batches are dealt to
  the steps at random (each step keeping its number of micro-batches). ``H_g <= 1``: the steps are at least
  as mixed as a random arrangement of the same micro-batches (lhotse's random bucket order, LongAlign's
  group shuffle). With padded cost a micro-batch is length-homogeneous, so ``H`` cannot reach 1 when a step
  holds a few micro-batches of many samples; ``H_g`` can.
* **late** -- the share of the epoch's longest decile of samples that trains in the last quarter of the
  steps (quarter ``j`` holds the steps with ``floor(4 s / S) == j``). Random: 0.25; a length curriculum
  pushes it up.
* **q_cv** -- the coefficient of variation of the four quarters' mean sample length (unweighted over
  samples). Random: a few hundredths (it shrinks with the epoch's size).
* **rough** -- ``mean_s (m_s - m_{s-1})^2`` over consecutive optimizer steps / twice H's denominator: how
  unlike each step is to the one before. Random batching: ~1; the same steps in a random order: ~H; a
  smooth length ramp: near 0; homogeneous steps that alternate short and long: up to ~2H. H and q_cv do not
  see order at the step scale and rough does: the replay's AdamW paid for it at equal steps and equal H
  (benchmarks/results/2026-12-05_what-the-default-trains.md, "Equal steps, roughness, and a long epoch").
* **timing** -- the largest distance from 0.5 of a length decile's mean position in the epoch (a sample's
  position: ``(s + 0.5) / S`` for its optimizer step ``s``; deciles of the epoch's samples by length). Random
  batching: a few hundredths. ``late`` follows only the longest tenth, and ``q_cv`` misses a tenth held back
  when the next tenths go early in its place (the quarters' mean lengths even out); timing sees any tenth
  that trains early or late -- the default holds its shortest samples back until the epoch's end (they pack
  into a few steps of hundreds) and scores ~0.3.

Example: two ranks, one micro-batch each, four samples of lengths 10, 10, 1000, 1000. Steps
``[[10], [1000]]``, ``[[10], [1000]]`` are perfectly mixed (``m_s`` equal, H = H_g = 0); steps
``[[10], [10]]``, ``[[1000], [1000]]`` are a curriculum of homogeneous steps (H_g = 3 in expectation: a random
deal of the same four micro-batches is mixed two times in three; 2.8 over the 64 deals drawn here). Order:
homogeneous steps short, long, short, long change at every step (as rough as steps can be); short, short,
long, long change at 3 of the 7 steps, so they are 7/3 ~ 2.3 times smoother.

>>> from evenflow.sim import Schedule
>>> ls = np.array([10, 10, 1000, 1000])
>>> mixed = Schedule.from_steps([[[0], [2]], [[1], [3]]], 2)
>>> sorted_ = Schedule.from_steps([[[0], [1]], [[2], [3]]], 2)
>>> round(step_composition(mixed, ls)["H_g"], 1), round(step_composition(sorted_, ls)["H_g"], 1)
(0.0, 2.8)
>>> ls = np.array([10, 1000] * 4)
>>> alternating = Schedule.from_steps([[[0]], [[1]], [[2]], [[3]], [[4]], [[5]], [[6]], [[7]]], 1)
>>> runs = Schedule.from_steps([[[0]], [[2]], [[1]], [[3]], [[4]], [[6]], [[5]], [[7]]], 1)
>>> round(step_composition(alternating, ls)["rough"] / step_composition(runs, ls)["rough"], 1)
2.3
"""

from __future__ import annotations

import numpy as np

from .schedule import Schedule

__all__ = ["step_composition", "PERMUTATIONS"]

PERMUTATIONS = 64
"""Random arrangements averaged for the H and H_g denominators (seed 0): their mean varies by a few
percent between seeds, far less than the gaps the metrics are read for."""

LONG_DECILE = 0.1
"""``late`` follows the longest tenth of the epoch's samples."""

DECILES = 10
"""``timing`` compares the mean positions of this many length strata of equal sample counts."""


def _step_means(step_of: np.ndarray, num_steps: int, lengths: np.ndarray) -> np.ndarray:
    """``m_s`` for each step from per-sample step indices (every step holds >= 1 sample)."""
    w = lengths.astype(np.float64)
    num = np.bincount(step_of, weights=w * np.log(w), minlength=num_steps)
    den = np.bincount(step_of, weights=w, minlength=num_steps)
    return num / den


def step_composition(schedule: Schedule, lengths: np.ndarray, *, grad_accum_steps: int = 1,
                     permutations: int = PERMUTATIONS, seed: int = 0) -> dict:
    """H, H_g, late, q_cv, rough and timing of ``schedule`` (module docstring), plus the optimizer step count ``S``.

    ``lengths[i]`` is sample i's length (tokens). Deterministic for a given ``seed``.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if not len(schedule.sample):
        return {"S": 0, "H": float("nan"), "H_g": float("nan"), "late": float("nan"), "q_cv": float("nan"),
                "rough": float("nan"), "timing": float("nan")}
    ls = np.maximum(lengths[schedule.sample], 1)
    opt = schedule.step // grad_accum_steps
    used, step_of = np.unique(opt, return_inverse=True)  # drop optimizer steps without samples
    num_steps = used.size
    step_means = _step_means(step_of, num_steps, ls)
    var = float(np.var(step_means))
    lag = float(np.mean(np.diff(step_means) ** 2)) if num_steps > 1 else float("nan")
    rng = np.random.default_rng(seed)

    # H: the epoch's samples permuted into the same per-step sample counts.
    random_var = np.mean([np.var(_step_means(step_of, num_steps, ls[rng.permutation(ls.size)]))
                          for _ in range(permutations)])

    # H_g: the schedule's micro-batches (non-empty (loader step, rank) cells) dealt to the steps at random.
    cell = schedule.cell()
    cells, batch_of = np.unique(cell, return_inverse=True)
    step_of_batch = _batch_steps(batch_of, step_of, cells.size)
    group_var = np.mean([np.var(_step_means(step_of_batch[rng.permutation(cells.size)][batch_of], num_steps, ls))
                         for _ in range(permutations)])

    # late and q_cv: the epoch's order.
    quarter = (4 * step_of) // num_steps
    top = max(1, int(round(LONG_DECILE * ls.size)))
    longest = np.argsort(-ls, kind="stable")[:top]
    late = float((quarter[longest] == 3).mean())
    means = np.array([ls[quarter == j].mean() for j in range(4) if (quarter == j).any()])
    q_cv = float(means.std() / means.mean()) if means.size > 1 else 0.0
    return {"S": int(num_steps), "H": float(var / random_var) if random_var > 0 else float("nan"),
            "H_g": float(var / group_var) if group_var > 0 else float("nan"), "late": late, "q_cv": q_cv,
            "rough": float(lag / (2 * random_var)) if random_var > 0 else float("nan"),
            "timing": _timing(step_of, num_steps, ls)}


def _timing(step_of: np.ndarray, num_steps: int, lengths: np.ndarray) -> float:
    """The largest ``|mean position - 0.5|`` over the length deciles (ties in length keep schedule order)."""
    position = (step_of + 0.5) / num_steps
    decile = np.empty(lengths.size, dtype=np.int64)
    decile[np.argsort(lengths, kind="stable")] = np.arange(lengths.size) * DECILES // lengths.size
    counts = np.bincount(decile, minlength=DECILES)
    means = np.bincount(decile, weights=position, minlength=DECILES)[counts > 0] / counts[counts > 0]
    return float(np.abs(means - 0.5).max())


def _batch_steps(batch_of: np.ndarray, step_of: np.ndarray, num_batches: int) -> np.ndarray:
    """Optimizer step of each micro-batch (all its samples share one)."""
    out = np.empty(num_batches, dtype=np.int64)
    out[batch_of] = step_of
    return out
