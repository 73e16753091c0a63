"""Raw per-rank records of every arm -> per-arm metrics, time to quality, and the verdict with its spread.

NOTE [ Time model ]
    ``time_to_target_s`` of an arm = (samples it needs to reach the target held-out loss, read off its quality
    run's loss-vs-samples curve, linear between evaluations) / (its samples/s). The target is the ``fixed``
    arm's final held-out loss, so for ``fixed`` itself it is the epoch's samples / its throughput; an arm whose
    curve never reaches the target gets ``None``. Quality comes from one seeded run per arm and does not depend
    on the machine's load; only the denominator does.

    The denominator: each ABBA-interleaved chunk (NOTE [ Interleaved timing ] in evenflow.demo.train) gives one
    rate in *real tokens/s*; an arm's samples/s is the median of those rates x the epoch's samples per real
    token, which is the same for every arm (every arm trains the same samples once). Why tokens, not samples:
    chunks hold equal optimizer steps, and an evenflow step holds 1 long chat or 40 short ones, so one arm's
    chunks ranged 54-212 samples and their samples/s followed their content, not the machine (per-round
    ratios 0.71-2.67x on an idle machine). Per token the chunks cost about the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["TIME_MODEL", "summarize_arm", "samples_to_target", "add_time_to_target", "verdict",
           "LOSS_GOAL", "TIME_GOAL"]

TIME_MODEL = ("time_to_target_s = samples needed to reach the fixed arm's final held-out loss (from the arm's "
              "quality-run loss-vs-samples curve) / the arm's samples/s = its median real tokens/s over the "
              "ABBA-interleaved rounds x the epoch's samples per real token (the same for every arm)")
LOSS_GOAL = 0.03
"""Goal: evenflow's final held-out loss within this many nats/token of the best fixed-batching arm."""
TIME_GOAL = 0.7
"""Goal: evenflow reaches the fixed arm's final held-out loss in at most this fraction of its time."""
FIXED_ARMS = ("fixed", "group_by_length")
LOAD_SLACK = 1.0
"""Load beyond our own ranks that the figures tolerate before the report warns (one extra busy process)."""


def summarize_arm(raw: Mapping[str, Any], initial_heldout: float) -> dict[str, Any]:
    """Metrics of one arm from its chunks and per-rank micro-batch records.

    Rank imbalance of a micro-step = max over ranks of its cost tokens / their mean (1.0 = perfectly even).
    Critical-path CPU time = sum over micro-steps of the slowest rank's CPU time: the epoch time with one
    dedicated core per rank, which wall time only shows on an otherwise idle machine.
    """
    per_rank, chunks = raw["per_rank_steps"], raw["chunks"]
    steps = min(len(r) for r in per_rank)
    if any(len(r) != steps for r in per_rank):
        raise ValueError(f"ranks ran different step counts {[len(r) for r in per_rank]}: the run was not aligned")
    flat = [rec for r in per_rank for rec in r]
    samples, real, padded = (sum(rec[k] for rec in flat) for k in ("samples", "real", "padded"))
    imbalance, critical = [], 0.0
    for s in range(steps):
        costs = np.array([r[s]["padded"] for r in per_rank], dtype=np.float64)
        imbalance.append(float(costs.max() / costs.mean()) if costs.mean() else 1.0)
        critical += max(r[s]["cpu_s"] for r in per_rank)
    # NOTE [ Time model ]: per-round rates in real tokens/s, expressed as samples/s at the epoch's mix.
    per_token = samples / real if real else 0.0
    rates = [c["real_tokens"] / c["wall_s"] * per_token for c in chunks if c["wall_s"] > 0 and c["real_tokens"]]
    median = float(np.median(rates)) if rates else 0.0
    batch_sizes = [rec["samples"] for rec in flat if rec["samples"]]
    return {
        "heldout_loss": float(chunks[-1]["heldout"]), "samples_per_s": median,
        "samples_per_s_per_round": rates, "samples_per_s_min": min(rates, default=0.0),
        "samples_per_s_max": max(rates, default=0.0),
        "tokens_per_s": median * real / samples if samples else 0.0,
        "optimizer_steps": int(raw["optimizer_steps"]), "planned_optimizer_steps": int(raw["planned_steps"]),
        "micro_batches_per_rank": steps, "samples": samples, "real_tokens": real, "padded_tokens": padded,
        "padded_efficiency": real / padded if padded else 0.0,
        "mean_rank_imbalance": float(np.mean(imbalance)) if imbalance else 1.0,
        "critical_path_cpu_s": critical, "timed_wall_s": float(sum(c["wall_s"] for c in chunks)),
        # Whole-epoch rate, next to the median: chunks of length-ordered arms differ in their samples' lengths.
        "samples_per_s_epoch": samples / max(sum(c["wall_s"] for c in chunks), 1e-9),
        "idle_batches": sum(1 for rec in flat if rec["samples"] == 0),
        "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else 0.0, "batch_sizes": batch_sizes,
        "mean_lr": float(np.mean(raw["lrs"])) if raw["lrs"] else 0.0,
        "curve": {"samples": [0, *np.cumsum([c["samples"] for c in chunks]).tolist()],
                  "wall_s": [0.0, *np.cumsum([c["wall_s"] for c in chunks]).tolist()],
                  "heldout_loss": [initial_heldout, *[c["heldout"] for c in chunks]]},
        "load1_per_round": [c.get("load1") for c in chunks],
    }


def samples_to_target(samples: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """First point where the curve reaches ``target``, linear between evaluations; ``None`` if it never does.

    >>> samples_to_target([0, 100, 200], [6.0, 5.0, 4.0], 4.5)
    150.0
    >>> samples_to_target([0, 100], [6.0, 5.0], 4.9) is None
    True
    """
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(samples[0])
            s0, s1, l0, l1 = samples[i - 1], samples[i], losses[i - 1], losses[i]
            return float(s0 + (s1 - s0) * (l0 - target) / (l0 - l1))
    return None


def add_time_to_target(arms: dict[str, dict[str, Any]]) -> float:
    """Fill ``time_to_target_s`` and ``samples_to_target`` of every arm (NOTE [ Time model ]); returns the target."""
    target = arms["fixed"]["heldout_loss"]
    for name, arm in arms.items():
        curve = arm["curve"]
        # fixed reaches its own final loss at the end by definition (not earlier on a noisy curve).
        needed = curve["samples"][-1] if name == "fixed" else samples_to_target(
            curve["samples"], curve["heldout_loss"], target)
        arm["samples_to_target"] = needed
        arm["time_to_target_s"] = needed / arm["samples_per_s"] if needed is not None and arm["samples_per_s"] else None
    return target


def _spread(values: Sequence[float]) -> dict[str, Any]:
    arr = np.asarray(values, dtype=np.float64)
    q1, q3 = np.percentile(arr, [25, 75])
    return {"median": float(np.median(arr)), "min": float(arr.min()), "max": float(arr.max()),
            "iqr": [float(q1), float(q3)], "per_round": arr.tolist(), "repeats": int(arr.size)}


def verdict(arms: Mapping[str, Mapping[str, Any]], *, load: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The medians and spreads the README quotes, the goals (met or not) and load warnings."""
    f, e = arms["fixed"], arms["evenflow"]
    rounds = min(len(f["samples_per_s_per_round"]), len(e["samples_per_s_per_round"]))
    ratios = [e["samples_per_s_per_round"][r] / f["samples_per_s_per_round"][r] for r in range(rounds)]
    out: dict[str, Any] = {"throughput_ratio": _spread(ratios),
                           "critical_path_ratio": f["critical_path_cpu_s"] / e["critical_path_cpu_s"],
                           "target_heldout_loss": f["heldout_loss"], "time_model": TIME_MODEL}
    if e["samples_to_target"] is not None:
        # Per round: evenflow's time to target over fixed's, both from that round's throughput.
        times = [(e["samples_to_target"] / e["samples_per_s_per_round"][r])
                 / (f["samples_to_target"] / f["samples_per_s_per_round"][r]) for r in range(rounds)]
        out["time_to_target_ratio"] = _spread(times)
    else:
        out["time_to_target_ratio"] = None
    best = min((a for a in FIXED_ARMS if a in arms), key=lambda a: arms[a]["heldout_loss"])
    gap = e["heldout_loss"] - arms[best]["heldout_loss"]
    ttt = out["time_to_target_ratio"]
    out.update(best_fixed_arm=best, heldout_gap_vs_best_fixed=gap, goals={
        "heldout_within_0.03_of_best_fixed": bool(gap <= LOSS_GOAL),
        "time_to_target_at_most_0.7x_fixed": bool(ttt is not None and ttt["median"] <= TIME_GOAL)})
    if "evenflow_sqrt_lr" in arms:  # > 0: the opt-in sqrt token LR rule trained better than evenflow's own
        out["sqrt_lr_gain"] = e["heldout_loss"] - arms["evenflow_sqrt_lr"]["heldout_loss"]
    out["warnings"] = load_warnings(load, ratios, world_size=world_size)
    out["reliable"] = not out["warnings"]
    return out


def load_warnings(load: Mapping[str, Any], ratios: Sequence[float], *, world_size: int) -> list[str]:
    """Why the wall-clock figures may not be trusted on this run (empty: no reason seen)."""
    warnings = []
    cores, peak = load["cores"], max([x for x in load["load1_during"] if x is not None] or [0.0])
    if cores is not None and cores < world_size:
        warnings.append(f"{cores} cores for {world_size} ranks: the ranks time-share, wall-clock figures understate "
                        "what dedicated cores would give (the critical-path ratio does not)")
    if peak > world_size + LOAD_SLACK:
        warnings.append(f"load average reached {peak:.1f} on {cores} cores while {world_size} ranks trained: other "
                        "processes competed for the CPU, so the wall-clock throughput and time-to-target figures "
                        "are unreliable (the held-out losses and the critical-path ratio are not affected)")
    if ratios and max(ratios) / min(ratios) > 1.5:
        warnings.append(f"the per-round throughput ratio ranged {min(ratios):.2f}-{max(ratios):.2f}x: the machine's "
                        "speed changed during the run; trust the median, not single rounds")
    return warnings


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
