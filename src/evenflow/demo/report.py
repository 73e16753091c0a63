"""Turn the raw per-rank step records of both runs into metrics, a table, a JSON report and a PNG."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["summarize_run", "format_table", "plot_report", "write_json"]

RUNS = ("fixed", "evenflow")


def summarize_run(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Metrics of one run from ``{"wall_s", "heldout_loss", "per_rank_steps": [[record, ...] per rank]}``.

    Rank imbalance of a step = max over ranks of its padded tokens / their mean (1.0 = perfectly even; the
    step waits for the slowest rank). Padded efficiency = real tokens / padded tokens, all ranks and steps.
    Critical-path CPU time = sum over steps of the slowest rank's CPU time for that step: the epoch time with
    one dedicated core per rank, which wall time only shows on an otherwise idle machine.
    """
    per_rank = raw["per_rank_steps"]
    steps = min(len(r) for r in per_rank)
    if any(len(r) != steps for r in per_rank):
        raise ValueError(f"ranks ran different step counts {[len(r) for r in per_rank]}: the run was not aligned")
    flat = [rec for r in per_rank for rec in r]
    samples = sum(rec["samples"] for rec in flat)
    real = sum(rec["real"] for rec in flat)
    padded = sum(rec["padded"] for rec in flat)
    imbalance, critical = [], 0.0
    for s in range(steps):
        costs = np.array([r[s]["padded"] for r in per_rank], dtype=np.float64)
        imbalance.append(float(costs.max() / costs.mean()) if costs.mean() else 1.0)
        critical += max(r[s]["cpu_s"] for r in per_rank)
    wall = float(raw["wall_s"])
    batch_sizes = [rec["samples"] for rec in flat if rec["samples"]]
    return {
        "wall_s": wall, "steps": steps, "samples": samples, "real_tokens": real, "padded_tokens": padded,
        "samples_per_s": samples / wall, "real_tokens_per_s": real / wall,
        "padded_efficiency": real / padded if padded else 0.0,
        "mean_rank_imbalance": float(np.mean(imbalance)) if imbalance else 1.0,
        "critical_path_cpu_s": critical, "cpu_s": sum(rec["cpu_s"] for rec in flat),
        "idle_batches": sum(1 for rec in flat if rec["samples"] == 0),
        "mean_batch_size": float(np.mean(batch_sizes)) if batch_sizes else 0.0,
        "batch_sizes": batch_sizes,
        "mean_step_loss_tokens": float(np.mean([r["global_tokens"] for r in per_rank[0]])) if steps else 0.0,
        "mean_lr": float(np.mean([r["lr"] for r in per_rank[0]])) if steps else 0.0,
        "heldout_loss": float(raw["heldout_loss"]),
    }


def format_table(summary: Mapping[str, Mapping[str, Any]], *, fixed_batch_size: int) -> str:
    """One plain-text table, fixed vs evenflow, plus the verdict lines."""
    f, e = summary["fixed"], summary["evenflow"]
    rows = [
        ("samples/s", f"{f['samples_per_s']:.2f}", f"{e['samples_per_s']:.2f}"),
        ("real tokens/s", f"{f['real_tokens_per_s']:.0f}", f"{e['real_tokens_per_s']:.0f}"),
        ("padded efficiency", f"{f['padded_efficiency']:.1%}", f"{e['padded_efficiency']:.1%}"),
        ("steps", f"{f['steps']}", f"{e['steps']}"),
        ("mean batch size", f"{f['mean_batch_size']:.1f}", f"{e['mean_batch_size']:.1f}"),
        ("rank imbalance (max/mean)", f"{f['mean_rank_imbalance']:.2f}", f"{e['mean_rank_imbalance']:.2f}"),
        ("wall time (s)", f"{f['wall_s']:.1f}", f"{e['wall_s']:.1f}"),
        ("critical-path CPU time (s)", f"{f['critical_path_cpu_s']:.1f}", f"{e['critical_path_cpu_s']:.1f}"),
        ("held-out loss / token", f"{f['heldout_loss']:.3f}", f"{e['heldout_loss']:.3f}"),
    ]
    head = ("", f"fixed (batch {fixed_batch_size})", "evenflow")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
    line = "  ".join("-" * w for w in widths)
    out = [f"{head[0]:<{widths[0]}}  {head[1]:>{widths[1]}}  {head[2]:>{widths[2]}}", line]
    out += [f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}" for a, b, c in rows]
    out.append(line)
    out.append(verdict(summary))
    return "\n".join(out)


def verdict(summary: Mapping[str, Mapping[str, Any]]) -> str:
    """How much faster, and how the held-out losses compare -- stated, not judged against a tolerance."""
    f, e = summary["fixed"], summary["evenflow"]
    speed = e["samples_per_s"] / f["samples_per_s"]
    faster = f"evenflow is {speed:.2f}x faster" if speed >= 1 else f"evenflow is {1 / speed:.2f}x slower"
    path = f["critical_path_cpu_s"] / e["critical_path_cpu_s"] if e["critical_path_cpu_s"] else float("nan")
    diff = e["heldout_loss"] - f["heldout_loss"]
    return "\n".join([
        f"{faster} than fixed batching (wall-clock samples/s, same samples and seed)",
        f"critical path (slowest rank's CPU time per step, summed): {path:.2f}x shorter with evenflow -- the "
        "speedup with one dedicated core per rank",
        f"held-out loss per token: evenflow {e['heldout_loss']:.3f} vs fixed {f['heldout_loss']:.3f} "
        f"({'+' if diff >= 0 else ''}{diff:.3f}) after {e['steps']} vs {f['steps']} optimizer steps",
    ])


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


def plot_report(path: str, *, lengths: Sequence[int], summary: Mapping[str, Mapping[str, Any]], cutoff: int,
                token_budget: int) -> None:
    """Three panels: realized length histogram, per-rank batch sizes, throughput of both runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fixed": "#bbbbbb", "evenflow": "#4477aa"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    arr = np.asarray(lengths)
    axes[0].hist(arr, bins=np.geomspace(max(1, arr.min()), arr.max() + 1, 40), color=colors["evenflow"])
    axes[0].set_xscale("log")
    axes[0].axvline(cutoff, color="#cc6677", linestyle="--", label=f"cutoff {cutoff}")
    axes[0].set(title=f"realized lengths ({arr.size} chats)", xlabel="tokens", ylabel="samples")
    axes[0].legend()

    biggest = max(max(summary[r]["batch_sizes"] or [1]) for r in RUNS)
    bins = np.arange(0.5, biggest + 1.5, max(1, biggest // 40))
    for run in RUNS:
        axes[1].hist(summary[run]["batch_sizes"], bins=bins, alpha=0.75, color=colors[run], label=run)
    axes[1].set(title=f"batch sizes per rank (budget {token_budget} tokens)", xlabel="samples per batch",
                ylabel="batches")
    axes[1].set_yscale("log")
    axes[1].legend()

    speeds = [summary[r]["samples_per_s"] for r in RUNS]
    bars = axes[2].bar(RUNS, speeds, color=[colors[r] for r in RUNS])
    for bar, run in zip(bars, RUNS):
        axes[2].annotate(f"{summary[run]['samples_per_s']:.1f} samples/s\n"
                         f"{summary[run]['real_tokens_per_s']:.0f} tokens/s",
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    axes[2].set(title="throughput (one epoch, same samples)", ylabel="samples/s")
    axes[2].set_ylim(0, max(speeds) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
