"""The demo's outputs: the side-by-side table with at most five verdict lines, the JSON report and the PNG."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .config import REFERENCE
from .plan import Matching

__all__ = ["HEADERS", "format_table", "verdict_lines", "plot_report", "write_json"]

HEADERS = {"hf_default": "HF default", "group_by_length": "group_by_length", "trl_packing": "TRL packing",
           "evenflow": "evenflow", "evenflow_summed": "evenflow summed"}
COLORS = {"hf_default": "#999999", "group_by_length": "#ccbb44", "trl_packing": "#ee6677", "evenflow": "#4477aa",
          "evenflow_summed": "#228833"}


def _interval(replay: Mapping[str, Any] | None, part: str) -> str:
    if replay is None:
        return "reference" if part == "verdict" else "--"
    if replay["ci95"] is None:  # the seed count only where rows exist (too few of them): else the reason says why
        return {"mean": "--", "ci": f"({replay['seeds']} seeds)" if replay["seeds"] else "--",
                "verdict": "no interval"}[part]
    lo, hi = replay["ci95"]
    return {"mean": f"{replay['mean']:+.3f} ({replay['seeds']})", "ci": f"[{lo:+.3f}, {hi:+.3f}]",
            "verdict": replay["verdict"]}[part]


def format_table(arms: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any], matching: Matching, *,
                 rounds: int, token_budget: int) -> str:
    """One plain-text table, one column per arm, then the verdict lines."""
    v = verdict["arms"]
    ref = HEADERS[REFERENCE]

    def row(label: str, fmt) -> tuple[str, ...]:
        return (label, *(fmt(name, a) for name, a in arms.items()))

    rows = [
        row("optimizer steps", lambda n, a: f"{a['optimizer_steps']}"),
        row("micro-batches per rank and step", lambda n, a: f"{matching.arms[n].micro_batches_per_step:.2f}"),
        row("peak tokens per micro-batch", lambda n, a: f"{a['peak_tokens']}"),
        row("padded efficiency", lambda n, a: f"{a['padded_efficiency']:.1%}"),
        row(f"real tokens/s (median, {rounds} rounds)", lambda n, a: f"{a['tokens_per_s']:.0f}"),
        row("  min-max over the rounds", lambda n, a: f"{a['tokens_per_s_min']:.0f}-{a['tokens_per_s_max']:.0f}"),
        row(f"  vs {ref}", lambda n, a: f"{v[n]['speed_vs_reference']:.2f}x"),
        row("held-out loss, this run", lambda n, a: f"{a['heldout_loss']:.3f}"),
        row(f"replay: minus {ref} (seeds)", lambda n, a: _interval(v[n]["replay"], "mean")),
        row("  paired 95% interval", lambda n, a: _interval(v[n]["replay"], "ci")),
        row("  verdict", lambda n, a: _interval(v[n]["replay"], "verdict")),
        row(f"time to {ref}'s final loss (s)",
            lambda n, a: "never" if a["time_to_target_s"] is None else f"{a['time_to_target_s']:.1f}"),
    ]
    head = ("", *(HEADERS[name] for name in arms))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join([f"{cells[0]:<{widths[0]}}", *(f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:]))])

    out = [fmt(head), line, *(fmt(r) for r in rows), line]
    out += verdict_lines(arms, verdict, matching, rounds=rounds, token_budget=token_budget)
    return "\n".join(out)


def verdict_lines(arms: Mapping[str, Mapping[str, Any]], verdict: Mapping[str, Any], matching: Matching, *,
                  rounds: int, token_budget: int) -> list[str]:
    """At most five lines: what the baselines are, speed, quality, time to target, warnings (if any)."""
    v, ref, others = verdict["arms"], HEADERS[REFERENCE], [n for n in arms if n != REFERENCE]
    hf = matching.arms[REFERENCE]
    what = [f"{ref} = Trainer's default: random batches of {matching.batch_size} per rank padded to the longest (the "
            f"largest batch whose epoch peak fits {token_budget} tokens), {hf.micro_batches_range[0]}-"
            f"{hf.micro_batches_range[1]} micro-batches per rank and step so its {hf.optimizer_steps} optimizer steps "
            f"equal evenflow's (HF's integer accumulation {matching.hf_accumulation} would take "
            f"{matching.hf_integer_steps})"]
    if "group_by_length" in arms:
        what.append("group_by_length = the same in HF's length-grouped order")
    if "trl_packing" in arms:
        what.append(f"TRL packing = trl.data_utils.pack_dataset(strategy='bfd') rows of {token_budget} tokens, "
                    "padding-free, position_ids restarting, one per rank, trained by the demo's loop (not SFTTrainer)")
    lines = ["; ".join(what)]
    lines.append(f"speed, real tokens/s (median of {rounds} ABBA-interleaved rounds) against {ref}'s "
                 f"{arms[REFERENCE]['tokens_per_s']:.0f}: "
                 + ", ".join(f"{HEADERS[n]} {v[n]['speed_vs_reference']:.2f}x" for n in others))
    lines.append(f"held-out loss minus {ref}'s, by the replay's paired 95% interval (benchmarks/quality_replay.py, "
                 f"rows of commit {verdict['replay_rows_commit']}): " + _quality(v, others))
    times = []
    for n in arms:
        t, rel = arms[n]["time_to_target_s"], v[n]["time_to_target_vs_reference"]
        times.append(f"{HEADERS[n]} never" if t is None else
                     f"{HEADERS[n]} {t:.0f} s" + ("" if n == REFERENCE or rel is None else f" ({rel:.2f}x)"))
    lines.append(f"time to {ref}'s final held-out loss {verdict['target_heldout_loss']:.3f} (this run; seconds at "
                 "each arm's median rate): " + ", ".join(times))
    if verdict["warnings"]:
        lines.append("WARNING: " + "; ".join(verdict["warnings"]))
    return lines


def _quality(v: Mapping[str, Any], others: Sequence[str]) -> str:
    """Each arm's replay verdict with its interval, or why it has none (said once when every arm shares it)."""
    reasons = {v[n]["replay"]["reason"] for n in others}
    if len(reasons) == 1 and all(v[n]["replay"]["ci95"] is None for n in others):
        return f"no interval for any arm: {reasons.pop()}"
    parts = []
    for n in others:
        rep = v[n]["replay"]
        parts.append(f"{HEADERS[n]} no interval ({rep['reason']})" if rep["ci95"] is None else
                     f"{HEADERS[n]} {rep['verdict']} ({rep['mean']:+.3f} [{rep['ci95'][0]:+.3f}, "
                     f"{rep['ci95'][1]:+.3f}], {rep['seeds']} seeds)")
    return "; ".join(parts)


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


def plot_report(path: str, *, arms: Mapping[str, Mapping[str, Any]], target: float) -> None:
    """One panel: every arm's held-out loss against seconds at its median throughput (NOTE [ Time model ])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, a in arms.items():
        if a["curve"]["seconds"]:
            ax.plot(a["curve"]["seconds"], a["curve"]["heldout_loss"], marker="o", ms=3, color=COLORS[name],
                    label=f"{HEADERS[name]} ({a['tokens_per_s']:.0f} real tokens/s)")
    ax.axhline(target, color="black", linestyle=":", label=f"{HEADERS[REFERENCE]} final {target:.3f}")
    ax.set(title="held-out loss per token vs wall-clock seconds (one epoch per arm)",
           xlabel="seconds (real tokens trained / the arm's median real tokens/s over the ABBA rounds)",
           ylabel="nats / token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
