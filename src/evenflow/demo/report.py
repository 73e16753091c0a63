"""Raw per-rank records of every arm -> per-arm metrics, time to the reference's loss, and the verdict.

NOTE [ Time model ]
    One throughput figure per arm, used everywhere (table, verdict, JSON, PNG): its *median real tokens/s* over
    the ABBA-interleaved rounds (NOTE [ Interleaved timing ] in evenflow.demo.train), with the rounds' min-max as
    its spread. Real tokens, not samples: every arm trains the same samples, hence the same real tokens, so the
    ratio of two arms' figures is the ratio of their epoch times; and a round's chunk of equal optimizer steps
    holds 1 long chat or 40 short ones, so samples/s followed a chunk's content, not the machine. The median, not
    the epoch's sum: a load burst on the shared machine hits every arm in that round, and the median drops it.

    Seconds (the PNG's axis, time to target) = real tokens trained so far / that figure. ``time_to_target_s`` of an
    arm = seconds until its held-out curve (linear between evaluations) first reaches the reference's final
    held-out loss, ``None`` if it never does; the reference's own is its whole epoch. The measured cumulative
    wall-clock seconds of each chunk are in the JSON (``curve.wall_s``) beside them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .config import REFERENCE

__all__ = ["TIME_MODEL", "summarize_arm", "tokens_to_target", "add_time_to_target", "verdict", "load_warnings"]

TIME_MODEL = ("throughput = median over the ABBA-interleaved rounds of each round's real tokens / its wall-clock "
              "seconds (spread: the rounds' min-max); seconds = real tokens trained so far / throughput; "
              "time_to_target_s = seconds until the held-out curve first reaches the reference's final loss")
LOAD_SLACK = 1.0
"""Load beyond our own ranks that the figures tolerate before the report warns (one extra busy process)."""


def summarize_arm(raw: Mapping[str, Any], initial_heldout: float) -> dict[str, Any]:
    """Metrics of one arm from its chunks and per-rank micro-batch records (each tagged with its step).

    Rank imbalance of a step = max over ranks of its cost tokens / their mean (1.0 = perfectly even).
    Critical-path CPU time = sum over steps of the slowest rank's CPU time: the epoch time with one dedicated
    core per rank, which wall time only shows on an otherwise idle machine.
    """
    per_rank, chunks = raw["per_rank_steps"], raw["chunks"]
    steps_per_rank = [1 + max((rec["step"] for rec in r), default=-1) for r in per_rank]
    if len(set(steps_per_rank)) != 1:
        raise ValueError(f"ranks ran different optimizer step counts {steps_per_rank}: the run was not aligned")
    steps = steps_per_rank[0]
    flat = [rec for r in per_rank for rec in r]
    samples, real, padded = (sum(rec[k] for rec in flat) for k in ("samples", "real", "padded"))
    cost = np.zeros((len(per_rank), steps))
    cpu = np.zeros((len(per_rank), steps))
    for r, records in enumerate(per_rank):
        for rec in records:
            cost[r, rec["step"]] += rec["padded"]
            cpu[r, rec["step"]] += rec["cpu_s"]
    mean_cost = cost.mean(axis=0)
    imbalance = np.where(mean_cost > 0, cost.max(axis=0) / np.where(mean_cost > 0, mean_cost, 1), 1.0)
    rates = [c["real_tokens"] / c["wall_s"] for c in chunks if c["wall_s"] > 0 and c["real_tokens"]]
    median = float(np.median(rates)) if rates else 0.0
    tokens = np.cumsum([0, *(c["real_tokens"] for c in chunks)]).astype(float)
    batch_sizes = [rec["samples"] for rec in flat if rec["samples"]]
    return {
        "heldout_loss": float(chunks[-1]["heldout"]),
        "tokens_per_s": median, "tokens_per_s_per_round": rates,
        "tokens_per_s_min": min(rates, default=0.0), "tokens_per_s_max": max(rates, default=0.0),
        "tokens_per_s_iqr": [float(x) for x in np.percentile(rates, [25, 75])] if rates else [0.0, 0.0],
        "optimizer_steps": int(raw["optimizer_steps"]), "planned_optimizer_steps": int(raw["planned_steps"]),
        "micro_batches_per_rank": len(flat) / len(per_rank), "samples": samples, "real_tokens": real,
        "padded_tokens": padded, "padded_efficiency": real / padded if padded else 0.0,
        "peak_tokens": max((rec["padded"] for rec in flat), default=0),
        "mean_rank_imbalance": float(imbalance.mean()) if steps else 1.0,
        "critical_path_cpu_s": float(cpu.max(axis=0).sum()), "timed_wall_s": float(sum(c["wall_s"] for c in chunks)),
        "idle_batches": sum(1 for rec in flat if rec["samples"] == 0),
        "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        "mean_lr": float(np.mean(raw["lrs"])) if raw["lrs"] else 0.0,
        "curve": {"samples": [0, *np.cumsum([c["samples"] for c in chunks]).tolist()],
                  "real_tokens": tokens.tolist(),
                  "seconds": (tokens / median).tolist() if median else [],
                  "wall_s": [0.0, *np.cumsum([c["wall_s"] for c in chunks]).tolist()],
                  "heldout_loss": [initial_heldout, *[c["heldout"] for c in chunks]]},
        "load1_per_round": [c.get("load1") for c in chunks],
    }


def tokens_to_target(tokens: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """First point where the curve reaches ``target``, linear between evaluations; ``None`` if it never does.

    >>> tokens_to_target([0, 100, 200], [6.0, 5.0, 4.0], 4.5)
    150.0
    >>> tokens_to_target([0, 100], [6.0, 5.0], 4.9) is None
    True
    """
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(tokens[0])
            t0, t1, l0, l1 = tokens[i - 1], tokens[i], losses[i - 1], losses[i]
            return float(t0 + (t1 - t0) * (l0 - target) / (l0 - l1))
    return None


def add_time_to_target(arms: dict[str, dict[str, Any]]) -> float:
    """Fill every arm's ``tokens_to_target`` and ``time_to_target_s`` (NOTE [ Time model ]); returns the target."""
    target = arms[REFERENCE]["heldout_loss"]
    for name, arm in arms.items():
        curve = arm["curve"]
        # The reference reaches its own final loss at the end by definition (not earlier on a noisy curve).
        needed = curve["real_tokens"][-1] if name == REFERENCE else tokens_to_target(
            curve["real_tokens"], curve["heldout_loss"], target)
        arm["tokens_to_target"] = needed
        arm["time_to_target_s"] = needed / arm["tokens_per_s"] if needed is not None and arm["tokens_per_s"] else None
    return target


def verdict(arms: Mapping[str, Mapping[str, Any]], comparisons: Mapping[str, Mapping[str, Any]], *,
            load: Mapping[str, Any], world_size: int, rows_commit: str) -> dict[str, Any]:
    """Per arm against the reference: speed (ratio of the one throughput figure), this run's held-out gap, the
    replay's interval and its word, time to target; then the load warnings."""
    ref = arms[REFERENCE]
    out: dict[str, Any] = {"reference": REFERENCE, "target_heldout_loss": ref["heldout_loss"],
                           "time_model": TIME_MODEL, "replay_rows_commit": rows_commit, "arms": {}}
    for name, a in arms.items():
        ttt = a["time_to_target_s"]
        out["arms"][name] = {
            "speed_vs_reference": a["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else None,
            "heldout_gap_this_run": a["heldout_loss"] - ref["heldout_loss"],
            "time_to_target_vs_reference": ttt / ref["time_to_target_s"] if ttt and ref["time_to_target_s"] else None,
            "replay": dict(comparisons[name]) if name != REFERENCE else None}
    out["warnings"] = load_warnings(load, world_size=world_size)
    out["reliable"] = not out["warnings"]
    return out


def load_warnings(load: Mapping[str, Any], *, world_size: int) -> list[str]:
    """Why the wall-clock figures may not be trusted on this run (empty: no reason seen)."""
    warnings = []
    cores, peak = load["cores"], max([x for x in load["load1_during"] if x is not None] or [0.0])
    if cores is not None and cores < world_size:
        warnings.append(f"{cores} cores for {world_size} ranks: the ranks time-share the CPU")
    if peak > world_size + LOAD_SLACK:
        warnings.append(f"load average reached {peak:.1f} on {cores} cores: other processes competed for the CPU, "
                        "so the throughput and time figures are noisy (the held-out losses are not)")
    return warnings
