"""The demo's outputs: the side-by-side table with the verdict lines, the JSON report and the PNG."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .report import LOSS_GOAL, TIME_GOAL

__all__ = ["format_table", "verdict_lines", "plot_report", "write_json", "HEADERS"]

HEADERS = {"fixed": "fixed", "group_by_length": "by length", "evenflow": "evenflow",
           "evenflow_sqrt_lr": "sqrt LR", "evenflow_summed": "summed"}
COLORS = {"fixed": "#999999", "group_by_length": "#ccbb44", "evenflow": "#4477aa",
          "evenflow_sqrt_lr": "#66ccee", "evenflow_summed": "#228833"}


def _row(label: str, arms: Mapping[str, Mapping], fmt) -> tuple[str, ...]:
    return (label, *(fmt(a) for a in arms.values()))


def format_table(arms: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any], *, batch_size: int,
                 accumulation: int, lr_text: str) -> str:
    """One plain-text table, one column per arm, then the verdict lines."""
    rows = [
        _row("samples/s (median)", arms, lambda a: f"{a['samples_per_s']:.2f}"),
        _row("  range over rounds", arms, lambda a: f"{a['samples_per_s_min']:.1f}-{a['samples_per_s_max']:.1f}"),
        _row("real tokens/s", arms, lambda a: f"{a['tokens_per_s']:.0f}"),
        _row("padded efficiency", arms, lambda a: f"{a['padded_efficiency']:.1%}"),
        _row("optimizer steps", arms, lambda a: f"{a['optimizer_steps']}"),
        _row("micro-batches per rank", arms, lambda a: f"{a['micro_batches_per_rank']}"),
        _row("mean batch size", arms, lambda a: f"{a['mean_batch_size']:.1f}"),
        _row("rank imbalance (max/mean)", arms, lambda a: f"{a['mean_rank_imbalance']:.2f}"),
        _row("critical-path CPU time (s)", arms, lambda a: f"{a['critical_path_cpu_s']:.1f}"),
        _row("mean LR", arms, lambda a: f"{a['mean_lr']:.2e}"),
        _row("step mix H_g (<= 1: mixed)", arms, lambda a: f"{a['composition']['H_g']:.2f}"),
        _row("longest tenth in last 1/4", arms, lambda a: f"{a['composition']['late']:.2f}"),
        _row("step-to-step change, rough", arms, lambda a: f"{a['composition']['rough']:.2f}"),
        _row("held-out loss / token", arms, lambda a: f"{a['heldout_loss']:.3f}"),
        _row("time to target (s)", arms,
             lambda a: "never" if a["time_to_target_s"] is None else f"{a['time_to_target_s']:.1f}"),
    ]
    head = ("", *(HEADERS[name] for name in arms))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join([f"{cells[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))])

    out = [fmt(head), line, *(fmt(r) for r in rows), line]
    out += verdict_lines(arms, verdict, batch_size=batch_size, accumulation=accumulation, lr_text=lr_text)
    return "\n".join(out)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def verdict_lines(arms: Mapping[str, Mapping[str, Any]], v: Mapping[str, Any], *, batch_size: int,
                  accumulation: int, lr_text: str) -> list[str]:
    e, f = arms["evenflow"], arms["fixed"]
    t = v["throughput_ratio"]
    speed = t["median"]
    word = f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"
    lines = [
        f"fixed = random batches of {batch_size} per rank x {accumulation} accumulation steps, sized from a "
        f"planner-only dry run to evenflow's samples per optimizer step; same samples, seed and LR schedule",
        f"evenflow is {word} than fixed batching (median of {t['repeats']} ABBA-interleaved rounds of wall-clock "
        f"real tokens/s; per-round ratio {t['min']:.2f}-{t['max']:.2f}, IQR {t['iqr'][0]:.2f}-{t['iqr'][1]:.2f})",
        f"critical path (slowest rank's CPU time per step, summed): {v['critical_path_ratio']:.2f}x shorter with "
        "evenflow -- the speedup with one dedicated core per rank",
    ]
    ttt = v["time_to_target_ratio"]
    if ttt is None:
        lines.append(f"time to quality: evenflow never reached fixed batching's final held-out loss "
                     f"{v['target_heldout_loss']:.3f} (goal <= {TIME_GOAL}x its time: NOT met)")
    else:
        lines.append(f"time to quality: evenflow reaches fixed batching's final held-out loss "
                     f"{v['target_heldout_loss']:.3f} in {e['time_to_target_s']:.1f} s vs "
                     f"{f['time_to_target_s']:.1f} s = {ttt['median']:.2f}x the time (median; rounds {ttt['min']:.2f}-{ttt['max']:.2f}; goal <= "
                     f"{TIME_GOAL}x: {_met(ttt['median'] <= TIME_GOAL)})")
    best = v["best_fixed_arm"]
    lines.append(f"held-out loss per token: evenflow {e['heldout_loss']:.3f} vs best fixed-batching arm ({best}) "
                 f"{arms[best]['heldout_loss']:.3f} ({v['heldout_gap_vs_best_fixed']:+.3f}; goal within {LOSS_GOAL}: "
                 f"{_met(v['heldout_gap_vs_best_fixed'] <= LOSS_GOAL)}) after {e['optimizer_steps']} vs "
                 f"{arms[best]['optimizer_steps']} optimizer steps")
    if "sqrt_lr_gain" in v:
        gain = v["sqrt_lr_gain"]
        helps = "helps" if gain > 0 else "does not help"
        lines.append(f"learning rate: {lr_text}; with the sqrt rule evenflow ends at "
                     f"{arms['evenflow_sqrt_lr']['heldout_loss']:.3f} (the rule {helps}: {gain:+.3f})")
    else:
        lines.append(f"learning rate: {lr_text}")
    lines.append("step composition (planned by the same planners, evenflow.sim.step_composition): H_g = variance of "
                 "the steps' mean log length over that of the same micro-batches dealt to steps at random (<= 1: as "
                 "mixed as random), late = share of the longest tenth of samples trained in the last quarter of the "
                 "steps (0.25: no curriculum), rough = how unlike each optimizer step is to the one before (random "
                 "batches ~1; AdamW pays for a high one)")
    lines.append(f"time model: {v['time_model']}")
    lines += [f"WARNING: {w}" for w in v["warnings"]]
    return lines


def write_json(path: str, report: Mapping[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2, default=_plain)
        fh.write("\n")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def plot_report(path: str, *, lengths: Sequence[int], arms: Mapping[str, Mapping[str, Any]], cutoff: int,
                token_budget: int, target: float) -> None:
    """Four panels: realized lengths, batch sizes per rank, held-out loss vs wall time and vs samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    arr = np.asarray(lengths)
    ax = axes[0, 0]
    ax.hist(arr, bins=np.geomspace(max(1, arr.min()), arr.max() + 1, 40), color=COLORS["evenflow"])
    ax.set_xscale("log")
    ax.axvline(cutoff, color="#cc6677", linestyle="--", label=f"cutoff {cutoff}")
    ax.set(title=f"realized lengths ({arr.size} chats)", xlabel="tokens", ylabel="samples")
    ax.legend()

    ax = axes[0, 1]
    biggest = max(max(a["batch_sizes"] or [1]) for a in arms.values())
    bins = np.arange(0.5, biggest + 1.5, max(1, biggest // 40))
    for name, a in arms.items():
        ax.hist(a["batch_sizes"], bins=bins, alpha=0.6, color=COLORS[name], label=HEADERS[name])
    ax.set(title=f"batch sizes per rank (budget {token_budget} tokens)", xlabel="samples per micro-batch",
           ylabel="micro-batches")
    ax.set_yscale("log")
    ax.legend()

    for ax, key, xlabel in ((axes[1, 0], "time", "wall time (s) at each arm's median samples/s"),
                            (axes[1, 1], "samples", "samples trained")):
        for name, a in arms.items():
            samples = np.asarray(a["curve"]["samples"], dtype=np.float64)
            x = samples / a["samples_per_s"] if key == "time" else samples
            ax.plot(x, a["curve"]["heldout_loss"], marker="o", ms=3, color=COLORS[name], label=HEADERS[name])
        ax.axhline(target, color="#cc6677", linestyle=":", label=f"fixed final {target:.3f}")
        ax.set(title=f"held-out loss vs {key}", xlabel=xlabel, ylabel="nats / token")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
