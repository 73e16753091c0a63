"""The cluster simulator (evenflow.sim): schedules, step-time model, calibration fit, evenflow's own policies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evenflow.planning import AlignmentConfig, GroupingConfig
from evenflow.sim import CostModel, PhaseCost, Schedule, evenflow_schedule, shard, simulate
from evenflow.sim.calibrate import QWEN3_8B, Timing, fit_phase, gpu_cost_model
from evenflow.sim.datasets import LengthShape, describe, matched_lengths, paper_lengths


def _brute_step_times(sched: Schedule, lengths: np.ndarray, model: CostModel) -> np.ndarray:
    # Independent per-batch evaluation: step = overhead + sum over phases of max over ranks.
    out = []
    for step in sched.batches():
        t = model.step_overhead
        for phase in model.phases:
            costs = []
            for members in step:
                ls = lengths[members]
                if len(ls) == 0:
                    costs.append(0.0)
                elif sched.layout == "padded":
                    costs.append(phase.per_batch + len(ls) * float(phase.sample_cost(np.array([ls.max()]))[0]))
                else:
                    costs.append(phase.per_batch + float(phase.sample_cost(ls).sum()))
            t += max(costs)
        out.append(t)
    return np.array(out)


def test_schedule_from_steps_roundtrip_and_coverage() -> None:
    sched = Schedule.from_steps([[[4, 1], [0]], [[2], []]], world_size=2)
    assert sched.num_steps == 2
    assert sched.batches() == [[[4, 1], [0]], [[2], []]]
    missing, dup = sched.coverage(5)
    assert missing.tolist() == [3] and dup.tolist() == []
    with pytest.raises(AssertionError, match="1 samples missing"):
        sched.check_exactly_once(5)


def test_from_rank_batches_pairs_by_position_like_ddp() -> None:
    sched = Schedule.from_rank_batches([[[0], [1], [2]], [[3]]])
    assert sched.batches() == [[[0], [3]], [[1], []], [[2], []]]


def test_step_time_is_max_over_ranks_padded_example() -> None:
    # NOTE [ Step time ] example: rank 0 [100, 300] -> 2 * 0.3; rank 1 [200] -> 0.2.
    model = CostModel(phases=(PhaseCost(per_token=1e-3),))
    r = simulate(Schedule.from_steps([[[0, 1], [2]]], world_size=2), np.array([100, 300, 200]), model)
    assert r.total_time == pytest.approx(0.6)
    assert r.padded_tokens == 800 and r.real_tokens == 600
    assert r.step_imbalance.tolist() == pytest.approx([1.5])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.sampled_from(["padded", "summed"]), st.integers(0, 10_000))
def test_simulate_matches_brute_force(world: int, n: int, layout: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 500, n)
    patches = np.where(rng.random(n) < 0.5, rng.integers(1, 64, n), 0)
    steps = int(rng.integers(1, 6))
    sched = Schedule(world, steps, rng.integers(0, steps, n), rng.integers(0, world, n), np.arange(n), layout)
    model = CostModel(phases=(PhaseCost(name="llm", per_batch=0.01, per_sample=1e-4, per_token=1e-5,
                                        per_token_sq=1e-8),
                              PhaseCost(name="vision", length_key="patches", per_batch=0.002, per_token=1e-4)),
                      step_overhead=0.05)
    r = simulate(sched, {"tokens": lengths, "patches": patches}, model)
    # The vision phase only sees samples with patches; brute force on the LLM phase alone plus vision alone.
    llm = CostModel(phases=(model.phases[0],), step_overhead=model.step_overhead)
    vis = CostModel(phases=(PhaseCost(per_batch=0.002, per_token=1e-4),))
    vis_sched = Schedule(world, steps, sched.step[patches > 0], sched.rank[patches > 0],
                         np.flatnonzero(patches > 0), layout)
    expected = _brute_step_times(sched, lengths, llm) + _brute_step_times(vis_sched, patches, vis)
    np.testing.assert_allclose(r.step_times, expected, rtol=1e-12)
    assert r.samples == n and r.real_tokens == int(lengths.sum())


def test_pad_to_multiple_of_rounds_the_padded_shape() -> None:
    model = CostModel(phases=(PhaseCost(per_token=1.0),), pad_to_multiple_of=64)
    r = simulate(Schedule.from_steps([[[0, 1]]], world_size=1), np.array([65, 10]), model)
    assert r.padded_tokens == 2 * 128 and r.total_time == pytest.approx(256.0)


def test_fit_recovers_known_coefficients() -> None:
    truth = PhaseCost(per_batch=0.004, per_sample=2e-4, per_token=3e-6, per_token_sq=5e-9)
    shapes = [(b, ln) for b in (1, 2, 4, 8) for ln in (32, 128, 512, 2048)]
    timings = [Timing(b, ln, truth.per_batch + b * float(truth.sample_cost(np.array([ln]))[0])) for b, ln in shapes]
    fitted, diag = fit_phase(timings)
    for name in ("per_batch", "per_sample", "per_token", "per_token_sq"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert diag["max_rel_err"] < 1e-9


def test_fit_is_robust_to_noise_and_non_negative() -> None:
    rng = np.random.default_rng(0)
    truth = PhaseCost(per_batch=0.01, per_token=1e-5, per_token_sq=2e-9)
    timings = [Timing(b, ln, (truth.per_batch + b * float(truth.sample_cost(np.array([ln]))[0]))
                      * (1 + 0.02 * rng.standard_normal()))
               for b in (1, 2, 4, 8) for ln in (64, 256, 1024, 4096)]
    fitted, _ = fit_phase(timings)
    assert fitted.per_token == pytest.approx(1e-5, rel=0.15)
    assert fitted.per_token_sq == pytest.approx(2e-9, rel=0.15)
    assert min(fitted.per_batch, fitted.per_sample, fitted.per_token, fitted.per_token_sq) >= 0


def test_gpu_model_follows_the_flop_count() -> None:
    m = gpu_cost_model("H100", mfu=0.5)
    rate = 989e12 * 0.5
    assert QWEN3_8B.matmul_params == pytest.approx(7.568e9, rel=1e-3)
    assert m.phases[0].per_token == pytest.approx(6 * QWEN3_8B.matmul_params / rate)
    assert m.phases[0].per_token_sq == pytest.approx(6 * 36 * 32 * 128 / rate)
    with pytest.raises(KeyError, match="unknown GPU"):
        gpu_cost_model("TPU")


def test_shard_matches_the_loaders_sharding() -> None:
    pytest.importorskip("torch")
    from evenflow.runtime.source import shard_indices

    for n, w, seed, epoch in [(10, 3, 0, 0), (601, 3, 5, 2), (7, 8, 1, 0)]:
        ours = shard(n, w, seed=seed, epoch=epoch)
        for r in range(w):
            assert ours[r].tolist() == shard_indices(n, rank=r, world_size=w, epoch=epoch, seed=seed, shuffle=True)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 6), st.integers(0, 300), st.sampled_from(["padded", "summed"]), st.integers(0, 1000))
def test_evenflow_schedule_invariants(world: int, n: int, cost: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, n)
    budget = 1024
    sched = evenflow_schedule(lengths, world_size=world, seed=seed,
                              grouping=GroupingConfig(token_budget=budget, cost=cost),
                              alignment=AlignmentConfig(buffer_size=32, max_steps_per_round=3))
    sched.check_exactly_once(n)  # join mode: every sample exactly once
    r = simulate(sched, lengths, CostModel())
    assert r.max_batch_tokens <= budget  # budgets hold
    assert r.samples == n and r.steps == sched.num_steps


def test_balanced_schedule_keeps_samples_steps_and_budget() -> None:
    pytest.importorskip("evenflow.balance")
    from evenflow.sim import balanced_schedule

    try:
        from evenflow.balance import rebalance_step

        rebalance_step([[0, 1], []], [[2, 2], []], budget=4)
    except NotImplementedError:
        pytest.skip("evenflow.balance.rebalance_step is not implemented yet")
    lengths = paper_lengths("sharegpt4o", 3000, seed=1, cutoff=4096)
    local = evenflow_schedule(lengths, world_size=8, grouping=GroupingConfig(token_budget=8192))
    bal = balanced_schedule(local, lengths, token_budget=8192)
    bal.check_exactly_once(len(lengths))
    assert bal.num_steps == local.num_steps
    model = CostModel(phases=(PhaseCost(per_token=1.0),))
    a, b = simulate(local, lengths, model), simulate(bal, lengths, model)
    assert b.max_batch_tokens <= 8192
    assert np.all(b.rank_load.max(axis=1) <= a.rank_load.max(axis=1) + 1e-9)  # no step gets slower in tokens


@pytest.mark.parametrize("shape", [LengthShape(mean=1400, cv=0.48), LengthShape(mean=1200, cv=1.0),
                                   LengthShape(mean=600, cv=0.8, short_fraction=0.4, short_mean=128)])
def test_matched_lengths_hit_the_target_cv(shape: LengthShape) -> None:
    d = describe(matched_lengths(20_000, shape, seed=3))
    assert d["cv"] == pytest.approx(shape.cv, abs=0.01)
    assert d["max"] <= shape.cutoff and d["mean"] == pytest.approx(shape.mean, rel=0.05)


def test_infeasible_mixture_is_refused_with_the_knob() -> None:
    with pytest.raises(ValueError, match="lower short_fraction"):
        matched_lengths(100, LengthShape(mean=800, cv=0.5, short_fraction=0.6, short_mean=50))


# -- global planning in the simulator ---------------------------------------------------------------------------

def _oracle_steps(lengths: np.ndarray, world: int, budget: int) -> int:
    from evenflow.planning import plan

    return -(-len(plan(lengths, GroupingConfig(token_budget=budget)).groups) // world)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 6), st.integers(0, 600), st.sampled_from([None, 4]), st.integers(0, 3))
def test_global_schedule_invariants(world: int, n: int, warmup, seed: int) -> None:
    from evenflow.sim.global_policy import global_schedule

    lengths = np.minimum(np.random.default_rng(seed).lognormal(5.5, 1.0, n).astype(np.int64) + 1, 2048)
    al = AlignmentConfig(buffer_size=64, max_steps_per_round=4, warmup_budgets=warmup)
    sched = global_schedule(lengths, world_size=world, grouping=GroupingConfig(token_budget=2048), alignment=al,
                            seed=seed)
    sched.check_exactly_once(n)  # every sample once (join mode), no rank skipped a step (one schedule)
    for step in sched.batches():
        for members in step:
            if members:
                assert len(members) * lengths[members].max() <= 2048
    # IDLE only in the last (drain) round, and only when it has fewer samples than slots
    last = sched.info["round_steps"][-1] if n else 0
    batches = sched.batches()
    assert all(all(members for members in step) for step in batches[:len(batches) - last])
    tail = [members for step in batches[len(batches) - last:] for members in step]
    assert sum(1 for m in tail if not m) <= max(0, len(tail) - sum(len(m) for m in tail))


def test_global_schedule_matches_the_oracle_steps_and_has_no_near_empty_drain() -> None:
    from evenflow.sim.global_policy import global_schedule

    lengths = paper_lengths("sharegpt4o", 8 * 600, seed=0, cutoff=8192)
    model = gpu_cost_model("H100")
    sched = global_schedule(lengths, world_size=8, grouping=GroupingConfig(token_budget=16384))
    sched.check_exactly_once(len(lengths))
    oracle_steps = _oracle_steps(lengths, 8, 16384)
    assert sched.num_steps <= oracle_steps + 1
    res = simulate(sched, lengths, model)
    busy = (res.rank_load > 0).sum(axis=1)
    assert busy.min() == 8  # every rank has work at every step, the last ones included
    assert res.padded_efficiency >= 0.97


def test_fitted_time_cost_differs_from_the_scorer_and_balances_time() -> None:
    from evenflow.sim.global_policy import global_schedule
    from evenflow.sim.timefit import fit_time_cost

    model = CostModel(phases=(PhaseCost(per_batch=0.01, per_token=1e-5, per_token_sq=4e-9),))
    cal = paper_lengths("sharegpt4o", 3000, seed=1, cutoff=8192)  # a calibration split, not the epoch
    tc = fit_time_cost(model, cal, seed=0)
    assert tc.phases[0].beta != model.phases[0].per_token_sq  # fitted with noise: not the scorer's numbers
    assert tc.phases[0].beta == pytest.approx(model.phases[0].per_token_sq, rel=0.25)
    lengths = paper_lengths("sharegpt4o", 64 * 120, seed=0, cutoff=8192)
    kw = dict(world_size=64, grouping=GroupingConfig(token_budget=16384))
    tokens = simulate(global_schedule(lengths, **kw), lengths, model)
    timed = simulate(global_schedule(lengths, time_cost=tc, **kw), lengths, model)
    assert 1 / timed.load_efficiency < 1 / tokens.load_efficiency  # balancing time beats balancing tokens
