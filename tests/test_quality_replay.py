"""benchmarks/training/quality_replay.py's arms are what its docstring says they are (no training: the schedules only).

The replay's figures are paired differences between arms, so each arm must train every sample of the epoch
exactly once, and a control must keep what it claims to keep: ``X_shuffled`` X's step token counts (to the
nearest sample), ``counts`` the default's samples per step, ``w4`` / ``accum2`` four micro-batches per step.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(BENCHMARKS))  # benchmarks/ holds training/ and the planning/mixed_packs it imports
    yield importlib.import_module("training.quality_replay")
    sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def lengths():
    # hh-rlhf-like: short dialogues with a tail, all within half the replay's budget (accum2 and w4 need it)
    rng = np.random.default_rng(3)
    return np.minimum(rng.lognormal(5.0, 0.8, 600).astype(int) + 8, 2048)


def _steps(schedule) -> list[list[int]]:
    return [s for s in ([i for g in step for i in g] for step in schedule.batches()) if s]


def test_every_arm_trains_every_sample_once(replay, lengths):
    for arm in replay.ARMS + replay.CONTROL_ARMS:
        trained = sorted(i for s in _steps(replay._schedule(arm, lengths, seed=1)) for i in s)
        assert trained == list(range(len(lengths))), arm


def test_controls_keep_what_they_claim(replay, lengths):
    default = _steps(replay._schedule("default", lengths, seed=1))
    for arm in ("shuffled", "local_shuffled", "accum2_shuffled", "w4_shuffled"):
        base = _steps(replay._schedule("default" if arm == "shuffled" else arm[:-len("_shuffled")], lengths, seed=1))
        control = _steps(replay._schedule(arm, lengths, seed=1))
        assert len(control) == len(base), arm
        gap = np.abs([lengths[c].sum() - lengths[b].sum() for c, b in zip(control, base)])
        assert gap[:-1].max() <= lengths.max(), arm  # to the nearest sample (the last step takes the rest)
    counts = _steps(replay._schedule("counts", lengths, seed=1))
    assert [len(s) for s in counts] == [len(s) for s in default]
    matched = _steps(replay._schedule("fixed_matched", lengths, seed=1))
    sizes = [len(s) for s in matched]
    assert len(matched) == len(default) and max(sizes) - min(sizes) <= 1
    for arm in ("accum2", "w4"):
        groups = [[g for g in step if g] for step in replay._schedule(arm, lengths, seed=1).batches()]
        assert max(len(g) for g in groups) == 4, arm
        assert all(lengths[g].max() * len(g) <= 2048 for step in groups for g in step), arm


def test_half_budget_arms_refuse_long_samples(replay, lengths):
    with pytest.raises(ValueError, match="w4 needs every sample within half the budget"):
        replay._schedule("w4", np.append(lengths, 3000), seed=1)


def test_summary_pairs_by_seed_and_keeps_settings_apart(replay):
    rows = [{"data": "hh_rlhf", "arm": arm, "seed": seed, "heldout_loss": loss, "optimizer_steps": 20,
             "padded_efficiency": 1.0, "H": 1.0, "H_g": 1.0, "late": 0.25, "q_cv": 0.02}
            for seed in range(3) for arm, loss in (("default_nolr", 6.0 + seed), ("shuffled", 5.9 + seed))]
    rows += [{**r, "optimizer": "sgd", "heldout_loss": r["heldout_loss"] + (0.5 if r["arm"] == "shuffled" else 0)}
             for r in rows[:6]]
    rows += [{**r, "warmup": 0.2, "heldout_loss": r["heldout_loss"] - (0.3 if r["arm"] == "default_nolr" else 0)}
             for r in rows[:6]]
    summary = replay.summarize(rows)
    assert list(summary) == ["hh_rlhf", "hh_rlhf warmup=0.2", "hh_rlhf@sgd"]
    assert summary["hh_rlhf"]["paired"]["default_nolr-shuffled"]["mean"] == pytest.approx(0.1)
    assert summary["hh_rlhf@sgd"]["paired"]["default_nolr-shuffled"]["mean"] == pytest.approx(-0.4)
    assert summary["hh_rlhf warmup=0.2"]["paired"]["default_nolr-shuffled"]["mean"] == pytest.approx(-0.2)
    assert summary["hh_rlhf"]["paired"]["default_nolr-shuffled"]["better_on"] == 0


def test_order_arms_reorder_the_defaults_steps_only(replay, lengths):
    from evenflow.planning.pooled import mix, plan

    default = _steps(replay._schedule("default", lengths, seed=1))
    for arm in (*replay.ORDER_ARMS, *replay.LIBRARY_ORDER, "default_permuted"):
        steps = _steps(replay._schedule(arm, lengths, seed=1))
        assert sorted(map(sorted, steps)) == sorted(map(sorted, default)), arm
        assert steps != default, arm
    assert plan.round_order is mix.round_order  # the planner's own order is back


def test_the_library_order_arm_is_the_library_default_and_the_others_keep_theirs(replay, lengths):
    # Rows trained before the library's round order changed stay reproducible: their arms pin the alternation.
    from evenflow.planning import GroupingConfig
    from evenflow.sim import global_schedule

    library = _steps(global_schedule(lengths, world_size=2, grouping=GroupingConfig(token_budget=4096), seed=1))
    assert all(_steps(replay._schedule(arm, lengths, seed=1)) == library for arm in replay.LIBRARY_ORDER)
    assert _steps(replay._schedule("default_nolr", lengths, seed=1)) != library


def test_nosteer_arm_only_turns_the_steering_off(replay, lengths):
    from evenflow.planning.pooled import mix

    tolerance = mix.STEER_TOLERANCE
    default, nosteer = (replay._schedule(arm, lengths, seed=1) for arm in ("default", "default_nosteer"))
    assert mix.STEER_TOLERANCE == tolerance  # restored
    assert _steps(nosteer) != _steps(default) and abs(nosteer.num_steps - default.num_steps) <= 1


def test_old_rows_get_the_composition_their_arm_plans(replay, lengths, monkeypatch):
    class Prepared:
        pass

    prepared = Prepared()
    prepared.lengths = lengths
    monkeypatch.setattr(replay, "_prepare", lambda data, seed: (None, prepared))
    old = {"H": 1.0, "H_g": 1.0, "late": 0.25, "q_cv": 0.02}  # a row written before `rough` existed
    steps = len(_steps(replay._schedule("default", lengths, seed=1)))
    rows = [{"data": "hh_rlhf", "arm": arm, "seed": 1, "heldout_loss": 6.0, "optimizer_steps": steps, **old, **extra}
            for arm in ("default_nolr", "default_smooth") for extra in ({}, {"optimizer": "sgd"})]
    full = {**rows[0], **replay.composition(replay._schedule("fixed", lengths, 1), lengths), "arm": "fixed"}
    stale = {**rows[0], "optimizer_steps": steps + 5}  # trained before its arm changed: not its schedule today
    assert replay.fill_composition(rows + [dict(full), stale]) == 4  # a complete row and a stale one are left alone
    assert "rough" not in stale
    for r in rows:
        assert r == {**r, **replay.composition(replay._schedule(r["arm"], lengths, 1), lengths)}
    # the metric tells the orders apart: the planner's alternation is rougher than the zigzag of the same steps
    assert rows[0]["rough"] > 2 * rows[2]["rough"], rows


def test_the_demos_arms_are_the_replays(replay, lengths):
    """``evenflow demo`` quotes the replay's intervals for its arms: each is the same steps (fingerprint) as the
    replay arm it names, built by the one definition in evenflow.demo.steps."""
    pytest.importorskip("trl", reason="the TRL packing arm runs TRL's pack_dataset")
    from evenflow.demo import DemoConfig
    from evenflow.demo.plan import match_arms
    from evenflow.demo.replay import REPLAY_ARMS

    plans = match_arms(DemoConfig(train_samples=len(lengths), seed=1), lengths, lengths // 2).arms
    assert set(REPLAY_ARMS) == set(plans)
    for arm, replay_arm in REPLAY_ARMS.items():
        assert replay.fingerprint(replay._schedule(replay_arm, lengths, seed=1)) == plans[arm].fingerprint, arm
    assert set(replay.DEMO_ARMS) <= set(REPLAY_ARMS.values())
    for arm in replay.DEMO_ARMS:
        assert (arm, "fixed_matched") in replay.CONTROLS, arm  # summarized against the demo's reference


def test_the_interval_is_the_demos(replay):
    from evenflow.demo.replay import paired_interval

    diffs = np.random.default_rng(4).normal(0.01, 0.02, 16)
    assert replay._interval(diffs) == paired_interval(diffs)
