"""The quality verdict from stored replay rows: one seed of the demo decides little, many paired seeds do.

``benchmarks/quality_replay.py`` trains each arm's exact steps ([`evenflow.demo.steps`][evenflow.demo.steps]) in one
process for many seeds and appends one JSON row per (data, arm, seed) to ``benchmarks/results/quality_replay.jsonl``.
For an arm and the reference, the paired per-seed differences of held-out loss give a mean and a 95 % bootstrap
interval over seeds, and the verdict word follows from the interval alone:

    interval entirely below 0 -> "better"; entirely above 0 -> "worse"; straddling 0 -> "within noise"

and "no interval" -- said, not faked -- when fewer than [`MIN_SEEDS`][MIN_SEEDS] paired seeds exist, the demo's setting
is not the replay's, the rows are not found (an installed package has no ``benchmarks/``), or the stored rows
are not the steps this demo's arm trains today (checked on the demo's own seed: the row's schedule fingerprint,
or, for rows stored before fingerprints, its optimizer step count).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from .config import REFERENCE, DemoConfig

__all__ = ["MIN_SEEDS", "REPLAY_ARMS", "ROWS", "Comparison", "compare", "load_rows", "paired_interval",
           "replay_arm", "rows_commit", "same_setting", "word"]

MIN_SEEDS = 16
"""Fewest paired seeds behind an interval the verdict quotes."""
BOOTSTRAP = 10_000
"""Resamples of the seeds (seeded: the same rows always give the same interval)."""
REPLAY_DATA = "chitchat"
"""The replay's data set that is the demo's (1,000 chitchat chats per seed)."""
REPLAY_ARMS = {"hf_default": "fixed_matched", "group_by_length": "group_by_length", "trl_packing": "trl_packed",
               "evenflow": "default_smooth", "evenflow_summed": "default_summed"}
"""Each demo arm's name in the replay (without a token LR rule)."""
ROWS = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "quality_replay.jsonl"
"""Where a clone keeps the replay's rows."""
NOT_TRAINING = ("heldout_samples", "rounds", "arms", "timeout_s", "num_workers", "seed")
"""DemoConfig fields that do not change what an arm trains (the replay holds out 256 chats; it spans seeds)."""


@dataclass(frozen=True)
class Comparison:
    """One arm's held-out loss minus the reference's over the replay's paired seeds."""

    arm: str
    replay_arm: str | None
    seeds: int
    mean: float | None
    ci95: tuple[float, float] | None
    verdict: str
    """"better", "worse", "within noise" or "no interval"."""
    reason: str
    """Why there is no interval (empty when there is one)."""
    revisions: tuple[str, ...] = ()
    """The git revisions the rows behind the interval were trained at (the arm's and the reference's rows; a row
    stored before rows carried one counts as ``"unrecorded"``)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def replay_arm(arm: str, config: DemoConfig) -> str | None:
    """The replay's name for ``arm`` under ``config``'s LR rule, or None when the replay has no such arm."""
    if config.lr_scaling == "none" or arm not in ("evenflow", "evenflow_summed"):
        return REPLAY_ARMS.get(arm)
    return "default_smooth_lr" if arm == "evenflow" and config.lr_scaling == "sqrt" else None


def same_setting(config: DemoConfig) -> list[str]:
    """The fields (other than [`NOT_TRAINING`][NOT_TRAINING]) in which ``config`` differs from the replay's setting."""
    base = DemoConfig()
    return [f.name for f in fields(DemoConfig) if f.name not in NOT_TRAINING and f.name != "lr_scaling"
            and getattr(config, f.name) != getattr(base, f.name)]


def load_rows(path: Path = ROWS) -> list[dict[str, Any]]:
    """The replay's rows of the demo's data set and optimizer (others are other settings); [] if none."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["data"] == REPLAY_DATA and "optimizer" not in r and "warmup" not in r]


def paired_interval(diffs: Sequence[float]) -> tuple[float, float]:
    """95 % bootstrap interval of the mean of per-seed differences (resampling seeds with a fixed generator).

    >>> paired_interval([0.5, 0.5, 0.5])
    (0.5, 0.5)
    """
    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, d.size, (BOOTSTRAP, d.size))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def word(ci95: tuple[float, float]) -> str:
    """The verdict an interval of (arm - reference) supports: lower held-out loss is better.

    >>> word((-0.03, -0.01)), word((-0.01, 0.02)), word((0.01, 0.03))
    ('better', 'within noise', 'worse')
    """
    lo, hi = ci95
    return "better" if hi < 0 else "worse" if lo > 0 else "within noise"


def compare(arm: str, rows: Sequence[Mapping[str, Any]], config: DemoConfig, *,
            own: Mapping[str, Mapping[str, Any]]) -> Comparison:
    """``arm`` against [`REFERENCE`][REFERENCE] from ``rows``; ``own[name]`` = the demo's ``{"fingerprint", "steps"}``
    for its seed, to check that the rows are the steps the demo trains."""
    name, ref = replay_arm(arm, config), replay_arm(REFERENCE, config)

    def none(reason: str, seeds: int = 0) -> Comparison:
        return Comparison(arm, name, seeds, None, None, "no interval", reason)

    if name is None or ref is None:
        return none(f"the replay has no {arm} arm with lr_scaling={config.lr_scaling!r}")
    differs = same_setting(config)
    if differs:
        return none(f"this run's setting is not the replay's ({', '.join(differs)} differ)")
    if not rows:
        return none(f"no replay rows at {ROWS}")
    by = {(r["arm"], r["seed"]): r for r in rows}
    for demo_arm, replay_name in ((arm, name), (REFERENCE, ref)):
        stored = by.get((replay_name, config.seed))
        if stored is None:
            continue
        mine = own[demo_arm]
        if ("schedule" in stored and stored["schedule"] != mine["fingerprint"]) or \
                stored["optimizer_steps"] != mine["steps"]:
            return none(f"the stored {replay_name} rows are not the steps {demo_arm} trains today (seed "
                        f"{config.seed}: fingerprint {stored.get('schedule', '-')} / {stored['optimizer_steps']} "
                        f"steps stored, {mine['fingerprint']} / {mine['steps']} now): re-run the replay")
    seeds = sorted(s for (a, s) in by if a == name and (ref, s) in by)
    if len(seeds) < MIN_SEEDS:
        return none(f"{len(seeds)} paired seeds < {MIN_SEEDS}", len(seeds))
    diffs = [by[(name, s)]["heldout_loss"] - by[(ref, s)]["heldout_loss"] for s in seeds]
    ci = paired_interval(diffs)
    revisions = sorted({str(by[(a, s)].get("revision") or "unrecorded") for s in seeds for a in (name, ref)})
    return Comparison(arm, name, len(seeds), float(np.mean(diffs)), ci, word(ci), "", tuple(revisions))


def rows_commit(path: Path = ROWS) -> str:
    """The last commit that changed the rows file (``+uncommitted`` when it has changes since), or ``"unknown"``."""
    try:
        log = subprocess.run(["git", "log", "-1", "--format=%h", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if log.returncode != 0 or not log.stdout.strip():
        return "unknown"
    return log.stdout.strip() + ("+uncommitted" if status.stdout.strip() else "")
