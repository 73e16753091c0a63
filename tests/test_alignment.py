"""Alignment round and loss weights: golden tables for decide_round, RankPlanner.apply and loss.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from evenflow.planning import (AlignmentConfig, GroupingConfig, LossTokenRule, RankReport, RoundDecision,
                               config_fingerprint, count_loss_tokens, decide_round, loss_scale, step_loss_scales,
                               wait_bound, window_totals)
from evenflow.planning.alignment import REPORT_WIDTH, SLOT_WIDTH, RankPlanner

FP = 7


def rep(groups, samples, exhausted=False, unread=0, *, fp=FP, stop=False, error=False):
    return RankReport(fp, groups, samples, exhausted, unread, stop, error)


def go(target, bound=-1):
    return RoundDecision(target, False, False, (), bound)


# -- decide_round ----------------------------------------------------------------------------------------------

DECISIONS = [
    # reports, config kwargs, (target, epoch_done, stop, error_ranks, steps_bound)
    ([rep(3, 6), rep(2, 2)], {}, (2, False, False, (), 6)),  # NOTE [ The alignment rule ] example
    ([rep(10, 20), rep(10, 20)], {}, (4, False, False, (), 20)),  # capped by max_steps_per_round
    ([rep(10, 20), rep(10, 20)], dict(max_steps_per_round=2), (2, False, False, (), 20)),
    ([rep(1, 3), rep(2, 3)], {}, (2, False, False, (), 3)),  # max-based: the rank with 1 group splits
    ([rep(1, 1), rep(1, 5)], {}, (1, False, False, (), 5)),  # min active N bounds T: a 1-sample rank
    ([rep(3, 9, unread=10), rep(1, 1, unread=3)], {}, (1, False, False, (), 19)),  # bound: max N + unread
    ([rep(3, 9, unread=-1), rep(3, 9)], {}, (3, False, False, (), -1)),  # unknown stream length
    # IDLE: a dry rank does not count as active; join mode keeps going, quota mode closes the epoch.
    ([rep(0, 0, True), rep(5, 40)], {}, (4, False, False, (), 40)),
    ([rep(0, 0, True), rep(5, 40)], dict(join=False), (0, True, False, (), 0)),
    ([rep(0, 0, True), rep(0, 0, True)], {}, (0, True, False, (), 0)),  # join: all dry ends the epoch
    ([rep(0, 0, True), rep(0, 0, True)], dict(join=False), (0, True, False, (), 0)),
    ([rep(2, 2, True), rep(5, 40)], dict(join=False), (2, False, False, (), 40)),  # exhausted but not dry
    # Stop and error are shared by every rank and end the round with T = 0.
    ([rep(3, 6, stop=True), rep(2, 2)], {}, (0, False, True, (), -1)),
    ([rep(3, 6), rep(0, 0, error=True), rep(2, 2, error=True)], {}, (0, False, False, (1, 2), -1)),
    ([rep(0, 0, True), rep(0, 0, True, stop=True)], {}, (0, True, True, (), 0)),
]


@pytest.mark.parametrize("reports,kwargs,expected", DECISIONS)
def test_decide_round_golden(reports, kwargs, expected):
    kwargs = {"max_steps_per_round": 4, **kwargs}  # explicit: the table must not move with the defaults
    d = decide_round(reports, AlignmentConfig(**kwargs))
    assert (d.target, d.epoch_done, d.stop, d.error_ranks, d.steps_bound) == expected
    # Every rank evaluates the same function on the same gathered rows: the wire format is lossless.
    rows = [RankReport.from_array(r.to_array()) for r in reports]
    assert all(r.to_array().shape == (REPORT_WIDTH,) for r in reports)
    assert decide_round(rows, AlignmentConfig(**kwargs)) == d


def test_decide_round_is_symmetric_in_rank_order():
    reports = [rep(3, 6, unread=2), rep(1, 1), rep(0, 0, True), rep(5, 9, unread=11)]
    for cfg in (AlignmentConfig(), AlignmentConfig(join=False)):
        d = decide_round(reports, cfg)
        assert decide_round(reports[::-1], cfg) == d


def test_fingerprint_mismatch_names_ranks():
    with pytest.raises(ValueError) as info:
        decide_round([rep(1, 1), rep(1, 1, fp=8), rep(1, 1), rep(1, 1, fp=9)], AlignmentConfig())
    msg = str(info.value)
    assert "7: [0, 2]" in msg and "8: [1]" in msg and "9: [3]" in msg
    assert "same seed" in msg


def test_fingerprint_is_stable_and_sensitive():
    g, a = GroupingConfig(token_budget=8), AlignmentConfig()
    assert config_fingerprint(g, a, 4) == config_fingerprint(GroupingConfig(token_budget=8), AlignmentConfig(), 4)
    assert 0 <= config_fingerprint(g, a, 4) < 2 ** 62
    others = [config_fingerprint(GroupingConfig(token_budget=9), a, 4), config_fingerprint(g, a, 3),
              config_fingerprint(g, AlignmentConfig(join=False), 4), config_fingerprint(g, a, 4, 1)]
    assert config_fingerprint(g, a, 4) not in others
    # Mapping order does not matter (canonicalized), values do.
    g1 = GroupingConfig(token_budget=8, extra_budgets={"a": 1, "b": 2})
    g2 = GroupingConfig(token_budget=8, extra_budgets={"b": 2, "a": 1})
    assert config_fingerprint(g1, a) == config_fingerprint(g2, a)


@pytest.mark.parametrize("reports,match", [
    ([rep(3, 2)], r"rank 0 sent inconsistent metadata: 3 groups for 2 samples"),
    ([rep(1, 1), rep(0, 4)], r"rank 1 sent inconsistent metadata: 0 groups for 4 samples"),
    ([rep(1, 1), rep(-1, -1)], r"rank 1 sent inconsistent metadata"),
    ([rep(0, 0), rep(0, 0, True)], r"ranks \[0\] did not report an exhausted stream"),
    ([], r"needs one report per rank"),
])
def test_inconsistent_metadata(reports, match):
    with pytest.raises(ValueError, match=match):
        decide_round(reports, AlignmentConfig())


@pytest.mark.parametrize("kwargs", [dict(max_steps_per_round=0), dict(buffer_size=0), dict(max_wait_rounds=-1),
                                    dict(buffer_size=True), dict(max_steps_per_round=2.0)])
def test_alignment_config_validation(kwargs):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        AlignmentConfig(**kwargs)


def test_wait_bound():
    assert wait_bound(AlignmentConfig(max_wait_rounds=8, buffer_size=1024)) == 8 + 1024 - 1


# -- RankPlanner.apply: split, overflow, IDLE ------------------------------------------------------------------


def planner(lengths, budget=1000, **alignment) -> RankPlanner:
    p = RankPlanner(GroupingConfig(token_budget=budget), AlignmentConfig(**alignment), seed=3)
    for i, length in enumerate(lengths):
        assert p.add(f"k{i}", length)
    return p


def shape(slots):
    return sorted(tuple(sorted(it.length for it in s)) for s in slots)


@pytest.mark.parametrize("target,sizes", [(1, [8]), (2, [4, 4]), (3, [2, 2, 4]), (4, [2, 2, 2, 2]),
                                          (8, [1] * 8)])
def test_split_halves_never_peels(target, sizes):
    p = planner([10] * 8)  # one group of 8 under the budget
    assert len(p.plan_local()) == 1
    slots = p.apply(go(target))
    assert sorted(len(s) for s in slots) == sizes  # 8 -> 4 + 4, never 7 + 1
    assert not p.buffer


def test_split_uses_contiguous_halves_of_the_sorted_group():
    assert shape(planner([6, 1, 5, 2, 4, 3]).apply(go(2))) == [(1, 2, 3), (4, 5, 6)]


def test_split_takes_the_costliest_group():
    # Budget 40: groups [10 x 4] (cost 40) and [2 x 4] (cost 8). T=3 halves the 10s, T=4 halves them again
    # (a [10, 10] costs 20 > 8), the cheap group stays whole.
    assert shape(planner([10] * 4 + [2] * 4, budget=40).apply(go(3))) == [(2, 2, 2, 2), (10, 10), (10, 10)]
    assert shape(planner([10] * 4 + [2] * 4, budget=40).apply(go(4))) == [(2, 2, 2, 2), (10,), (10,), (10, 10)]


def test_overflow_keeps_t_fullest_and_recycles_the_rest():
    p = planner([3, 10, 9, 6], budget=10)  # 4 singleton groups (any pair exceeds 10)
    assert len(p.plan_local()) == 4
    slots = p.apply(go(2))
    assert shape(slots) == [(9,), (10,)]  # fullest first
    assert sorted(it.length for it in p.buffer) == [3, 6]
    assert all(it.arrived == 0 for it in p.buffer) and p.rounds == 1


def test_overflow_ties_keep_the_oldest():
    p = planner([10, 10, 10], budget=10)
    assert [it.key for s in p.apply(go(1)) for it in s] == ["k0"]
    assert [it.key for it in p.buffer] == ["k1", "k2"]


@pytest.mark.parametrize("max_wait,expected", [(1, "a"), (8, "c")])
def test_overflow_age_priority(max_wait, expected):
    p = RankPlanner(GroupingConfig(token_budget=10), AlignmentConfig(max_wait_rounds=max_wait), seed=0)
    p.add("a", 3)
    p.add("b", 10)
    assert [it.key for s in p.apply(go(1)) for it in s] == ["b"]  # fullest; "a" is recycled
    p.add("c", 9)  # round 1: "a" has waited 1 round
    assert [it.key for s in p.apply(go(1)) for it in s] == [expected]


def test_idle_slots_and_zero_target():
    p = planner([])
    assert p.apply(go(3)) == [[], [], []] and p.rounds == 1  # the ageing clock ticks with every round
    q = planner([4, 4])
    assert q.apply(RoundDecision(0, True, False, (), 0)) == [] and len(q.buffer) == 2 and q.rounds == 0


def test_emission_order_is_shared_by_every_rank():
    # Same seed and round: every rank applies the same permutation to its cost-sorted slots, so step k of a
    # round pairs groups of similar cost across ranks.
    a, b = planner([10, 20, 30, 40], budget=40), planner([11, 21, 31, 41], budget=41)
    sa, sb = a.apply(go(4)), b.apply(go(4))
    assert [s[0].length for s in sa] == [s[0].length - 1 for s in sb]


def test_slot_counts_payload():
    p = RankPlanner(GroupingConfig(token_budget=100), AlignmentConfig(), seed=0)
    p.add("a", 5, loss_tokens=4)
    p.add("b", 7, loss_tokens=6)
    slots = p.apply(go(1))
    out = p.slot_counts(slots + [[]], width=3)
    assert out.shape == (3, SLOT_WIDTH) and out.dtype == np.int64
    assert out.tolist() == [[2, 10, 14, 12], [0, 0, 0, 0], [0, 0, 0, 0]]  # samples, loss, padded, real


def test_add_policies(caplog):
    base = dict(token_budget=10)
    p = RankPlanner(GroupingConfig(**base, oversize="alone"), AlignmentConfig())
    assert p.add("big", 20) and p.alone == ["big"] and len(p.buffer) == 1
    p = RankPlanner(GroupingConfig(**base, oversize="drop"), AlignmentConfig())
    with caplog.at_level(logging.WARNING, logger="evenflow"):
        with pytest.warns(UserWarning, match=r"dropped.*over-budget.*big") as caught:
            assert not p.add("big", 20)
    assert p.dropped == ["big"] and not p.buffer and len(caught) == 1  # counted, warned once
    assert not [r for r in caplog.records if r.name == "evenflow"]  # and not printed again by logging
    p = RankPlanner(GroupingConfig(**base), AlignmentConfig())
    with pytest.raises(ValueError, match=r"sample big: length 20 exceeds token_budget=10"):
        p.add("big", 20)


# -- loss weights ----------------------------------------------------------------------------------------------

COUNTS = [
    # labels, shift, expected
    ([-100, -100, 5, 6], True, 2),
    ([-100, -100, 5, 6], False, 2),
    ([5, 6, 7], True, 2),  # the first label is never predicted
    ([5, 6, 7], False, 3),
    ([5, -100, 6], True, 1),
    ([5, -100, 6], False, 2),
    ([7], True, 0),
    ([], True, 0),
    ([-100, -100], False, 0),
]


@pytest.mark.parametrize("labels,shift,expected", COUNTS)
def test_count_loss_tokens(labels, shift, expected):
    rule = LossTokenRule(shift=shift)
    assert count_loss_tokens(labels, rule) == expected
    assert count_loss_tokens(np.asarray(labels, dtype=np.int64), rule) == expected
    assert count_loss_tokens(torch.tensor(labels, dtype=torch.long), rule) == expected


def test_count_loss_tokens_options():
    assert count_loss_tokens(None) == 0
    assert count_loss_tokens([0, 0, 3, 0], LossTokenRule(ignore_index=0)) == 1
    assert count_loss_tokens([[1, 2], [3, -100]]) == 2  # reshaped to one row: [1, 2, 3, -100] shifted


def test_loss_scale():
    assert loss_scale(0, 0, 4) == 0.0  # a step with no supervised tokens: finite, zero
    assert loss_scale(0, 10, 4) == 0.0
    assert loss_scale(3, 4, 2) == 1.5
    assert loss_scale(1, 4, 2) == 0.5
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        loss_scale(1, 1, 0)
    with pytest.raises(ValueError, match="inconsistent token counts"):
        loss_scale(5, 4, 2)
    with pytest.raises(ValueError, match="inconsistent token counts"):
        loss_scale(-1, 4, 2)


def test_window_totals():
    assert window_totals([3, 1, 4, 1, 5], 2) == [4, 4, 5, 5, 5]  # partial last window
    assert window_totals([3, 1, 4, 1, 5], 1) == [3, 1, 4, 1, 5]
    assert window_totals([3, 1, 4, 1, 5], 3) == [8, 8, 8, 6, 6]
    assert window_totals([3, 1], 8) == [4, 4]
    assert window_totals([], 2) == []
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
        window_totals([1], 0)


def test_loss_note_example():
    # NOTE [ Loss scale ]: W = 2, t = [3, 1], m = [2.0, 6.0] -> both scaled losses are 3.0, DDP mean 3.0.
    scales = step_loss_scales(np.array([[3, 1]]))
    assert (np.array([2.0, 6.0]) * scales[0]).tolist() == [3.0, 3.0]


@pytest.mark.parametrize("world,steps,window", [(1, 3, 1), (2, 1, 1), (3, 5, 2), (4, 7, 3), (8, 6, 6)])
def test_scaled_means_rebuild_the_global_per_token_mean(world, steps, window):
    """Per window: sum over micro-steps of (DDP average over ranks of m_r * scale) == global per-token mean."""
    rng = np.random.default_rng(world * 100 + steps)
    tokens = rng.integers(0, 6, size=(steps, world))
    tokens[0, 0] = 0  # a rank with no supervised tokens at some step
    losses = [[rng.random(int(tokens[s, r])) for r in range(world)] for s in range(steps)]
    scales = step_loss_scales(tokens, window)
    assert np.all(np.isfinite(scales))
    for start in range(0, steps, window):
        win = range(start, min(start + window, steps))
        got = 0.0
        for s in win:
            means = [losses[s][r].mean() if tokens[s, r] else 0.0 for r in range(world)]
            got += sum(m * scales[s, r] for r, m in enumerate(means)) / world  # DDP averages over W
        every = np.concatenate([losses[s][r] for s in win for r in range(world)])
        want = every.mean() if every.size else 0.0
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_scaled_gradients_equal_the_single_process_reference():
    """Autograd check: DDP-averaged, accumulated gradients of scaled per-rank means == reference gradient."""
    torch.manual_seed(0)
    world, steps, window, dim = 3, 4, 2, 5
    w = torch.randn(dim, dtype=torch.float64)
    tokens = np.array([[2, 0, 3], [1, 4, 1], [5, 2, 0], [0, 0, 1]])
    xs = [[torch.randn(int(tokens[s, r]), dim, dtype=torch.float64) for r in range(world)] for s in range(steps)]
    ys = [[torch.randn(int(tokens[s, r]), dtype=torch.float64) for r in range(world)] for s in range(steps)]
    scales = step_loss_scales(tokens, window)
    for start in range(0, steps, window):
        win = range(start, min(start + window, steps))
        p = w.clone().requires_grad_(True)
        ref = torch.cat([((xs[s][r] @ p - ys[s][r]) ** 2) for s in win for r in range(world)]).mean()
        (want,) = torch.autograd.grad(ref, p)
        got = torch.zeros(dim, dtype=torch.float64)
        for s in win:
            for r in range(world):
                q = w.clone().requires_grad_(True)  # each rank's replica
                if tokens[s, r] == 0:
                    continue  # scale 0: contributes nothing
                mean = ((xs[s][r] @ q - ys[s][r]) ** 2).mean()
                (g,) = torch.autograd.grad(mean * float(scales[s, r]), q)
                got += g / world  # DDP all-reduce average, summed over the accumulation window
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# -- issue 10: agreement checks, STOP(rank, step), error details --------------------------------------------
def test_decide_round_names_the_earliest_stopping_rank_and_step():
    reports = [RankReport(7, 2, 4, False, 0, stop=True, stop_step=9), RankReport(7, 2, 4, False, 0),
               RankReport(7, 2, 4, False, 0, stop=True, stop_step=5)]
    d = decide_round(reports, AlignmentConfig())
    assert d.stop and d.target == 0 and (d.stop_rank, d.stop_step) == (2, 5)
    assert decide_round([RankReport(7, 2, 4, False, 0)] * 2, AlignmentConfig()).stop_rank == -1


@pytest.mark.parametrize("field, value, text", [
    ("epoch", 1, "ranks disagree on the epoch"),
    ("data", 99, "ranks disagree on the dataset"),
    ("resume", 6, "ranks disagree on the resumed state"),
    ("fingerprint", 8, "ranks disagree on the loader configuration"),
])
def test_decide_round_refuses_ranks_that_disagree_naming_both_sides(field, value, text):
    import dataclasses
    base = RankReport(7, 2, 4, False, 0)
    odd = dataclasses.replace(base, **{field: value})
    with pytest.raises(ValueError, match=text) as info:
        decide_round([base, odd, base], AlignmentConfig())
    assert "[0, 2]" in str(info.value) and "[1]" in str(info.value)
    if field == "resume":
        assert "no state" in str(info.value) and "step 3" in str(info.value)


def test_error_details_survive_the_fixed_size_exchange():
    from evenflow.errors import DETAIL_WIDTH, decode_detail, encode_detail

    class Custom(Exception):  # need not pickle: only its name and text travel
        pass
    row = encode_detail(Custom("naïve message " + "x" * 5000 + " THE END"), 41)
    assert row.shape == (DETAIL_WIDTH,)
    name, message, index = decode_detail(row)
    assert (name, index) == ("Custom", 41) and message.startswith("naïve message") and message.endswith("THE END")
    assert len(message.encode()) <= 1024
    assert decode_detail(encode_detail(ValueError("v"), None)) == ("ValueError", "v", None)
    assert not encode_detail(None, None).any()
