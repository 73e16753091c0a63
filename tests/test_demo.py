"""The demo's parts, each against a hand-computed answer: the matching dry run, the schedule, the ABBA chunks,
the losses (padded and packed), time to target and the verdict. The quick run end to end is in test_readme.py."""

from __future__ import annotations

import doctest
import importlib.util

import numpy as np
import pytest
import torch

from evenflow.demo import ARMS, DemoConfig, quick_config, schedule_factor

HAS_HF = importlib.util.find_spec("transformers") is not None


def test_doctests():
    import evenflow.demo.report as report
    import evenflow.demo.train as train
    assert doctest.testmod(report).failed == 0 and doctest.testmod(train).failed == 0


@pytest.mark.parametrize("bad", [dict(arms=("evenflow",)), dict(arms=("fixed",)), dict(arms=("fixed", "evenflow", "x")),
                                 dict(arms=("fixed", "evenflow", "fixed")), dict(rounds=0), dict(warmup_fraction=1.0),
                                 dict(final_lr_fraction=0.0), dict(reference_tokens=0), dict(token_budget=100),
                                 dict(base_lr=float("nan"))])
def test_config_refuses(bad):
    with pytest.raises(ValueError):
        DemoConfig(**bad)


def test_quick_config_keeps_five_rounds_and_every_arm():
    q = quick_config()
    assert q.rounds >= 5 and q.arms == ARMS and q.train_samples < DemoConfig().train_samples
    assert "evenflow_summed" not in DemoConfig().arms  # too slow on CPU for make demo's ~5 minutes


def test_schedule_warms_up_then_decays_to_its_floor_in_optimizer_steps():
    cfg = DemoConfig(warmup_fraction=0.05, final_lr_fraction=0.1)
    values = [schedule_factor(s, 100, cfg) for s in range(100)]
    assert values[0] == pytest.approx(0.2) and values[4] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1) and max(values) == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))  # monotone after warm-up
    assert schedule_factor(0, 1, DemoConfig(warmup_fraction=0.0)) == pytest.approx(1.0)


def test_chunks_cover_the_epoch_and_the_last_drains():
    from evenflow.demo.train import chunk_bounds
    for total, rounds in ((119, 8), (125, 8), (5, 5), (3, 5)):
        sizes = chunk_bounds(total, rounds)
        assert len(sizes) == rounds and sizes[-1] is None
        assert sum(sizes[:-1]) == round(total * (rounds - 1) / rounds)


def test_matching_sizes_accumulation_from_the_dry_run():
    from evenflow.demo.plan import match_arms
    from evenflow.planning import GroupingConfig
    from evenflow.sim import global_schedule

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 400).astype(np.int64), 8, 1024)
    lengths[0] = 1024
    cfg = DemoConfig(train_samples=400, cutoff=1024, token_budget=1024)
    m = match_arms(cfg, lengths, loss_tokens=lengths // 2)
    # the loader's defaults at 2 ranks resolve to global planning: the dry run plans with it
    steps = global_schedule(lengths, world_size=2, grouping=GroupingConfig(token_budget=1024)).num_steps
    assert m.planning == "global" and m.evenflow_steps == steps and m.fixed_batch_size == 1
    # every arm's planned composition is reported; random fixed batches are as mixed as random (H_g ~ 1)
    assert set(m.composition) == {"evenflow", "evenflow_sqrt_lr", "evenflow_summed", "fixed", "group_by_length"}
    assert 0.6 < m.composition["fixed"]["H_g"] < 1.5 and m.composition["group_by_length"]["H_g"] > 2
    assert m.accumulation == max(1, round(400 / steps / 2))
    assert m.fixed_steps == -(-200 // m.accumulation)
    assert m.reference_tokens == round(int((lengths // 2).sum()) / steps)
    assert m.summed_steps <= m.evenflow_steps  # summed cost packs at least as tightly
    assert match_arms(DemoConfig(train_samples=400, cutoff=1024, token_budget=1024, reference_tokens=77),
                      lengths, lengths // 2).reference_tokens == 77


def _chunk(samples, wall, heldout, real_tokens=None):
    tokens = 60 * samples if real_tokens is None else real_tokens
    return {"samples": samples, "wall_s": wall, "heldout": heldout, "steps": 1, "load1": 1.0, "real_tokens": tokens}


def _raw(chunks, records, lrs=(1e-3,)):
    return {"chunks": chunks, "per_rank_steps": records, "optimizer_steps": len(lrs), "planned_steps": len(lrs),
            "lrs": list(lrs)}


def test_summarize_arm_metrics():
    from evenflow.demo.report import summarize_arm

    def rec(samples, real, padded, cpu):
        return {"samples": samples, "real": real, "padded": padded, "cpu_s": cpu, "loss_tokens": 1, "loss_sum": 1.0}

    # 240 real tokens in 4 samples: 60 tokens per sample. Chunk rates are tokens/s x 4/240 samples per token.
    raw = _raw([_chunk(2, 1.0, 5.0, 120), _chunk(2, 0.5, 4.0, 120), _chunk(0, 0.1, 4.0, 0)],
               [[rec(2, 90, 100, 1.0), rec(1, 50, 50, 0.5)], [rec(1, 100, 100, 2.0), rec(0, 0, 50, 0.1)]])
    s = summarize_arm(raw, initial_heldout=6.0)
    assert (s["micro_batches_per_rank"], s["samples"], s["real_tokens"], s["padded_tokens"]) == (2, 4, 240, 300)
    assert s["samples_per_s_per_round"] == [2.0, 4.0]  # an empty chunk is no throughput sample
    assert s["samples_per_s"] == 3.0 and s["padded_efficiency"] == pytest.approx(0.8)
    assert s["tokens_per_s"] == pytest.approx(3.0 * 240 / 4)
    assert s["mean_rank_imbalance"] == pytest.approx(1.0)  # padded costs [100, 100] then [50, 50]
    assert s["critical_path_cpu_s"] == pytest.approx(2.5) and s["idle_batches"] == 1
    assert s["curve"]["samples"] == [0, 2, 4, 4] and s["curve"]["heldout_loss"] == [6.0, 5.0, 4.0, 4.0]
    assert s["heldout_loss"] == 4.0
    # The rate follows a chunk's tokens, not its sample count: 1 long sample or 3 short ones in the same tokens
    # and time are the same throughput (NOTE [ Time model ]).
    raw["chunks"][:2] = [_chunk(1, 1.0, 5.0, 120), _chunk(3, 0.5, 4.0, 120)]
    assert summarize_arm(raw, initial_heldout=6.0)["samples_per_s_per_round"] == [2.0, 4.0]
    raw["per_rank_steps"][1].pop()
    with pytest.raises(ValueError, match="not aligned"):
        summarize_arm(raw, initial_heldout=6.0)


def _arm(rates, curve_samples, curve_loss, critical=10.0):
    return {"samples_per_s_per_round": rates, "samples_per_s": float(np.median(rates)), "heldout_loss": curve_loss[-1],
            "critical_path_cpu_s": critical, "optimizer_steps": 10,
            "curve": {"samples": curve_samples, "heldout_loss": curve_loss}}


def test_time_to_target_and_verdict_by_hand():
    from evenflow.demo.report import add_time_to_target, verdict

    arms = {"fixed": _arm([10.0] * 5, [0, 50, 100], [6.0, 5.0, 4.5], critical=20.0),
            "group_by_length": _arm([12.0] * 5, [0, 50, 100], [6.0, 5.1, 4.6]),
            "evenflow": _arm([20.0] * 5, [0, 50, 100], [6.0, 4.5, 4.4])}
    target = add_time_to_target(arms)
    assert target == 4.5
    assert arms["fixed"]["time_to_target_s"] == pytest.approx(10.0)  # its whole epoch: 100 samples at 10/s
    assert arms["evenflow"]["samples_to_target"] == pytest.approx(50.0)
    assert arms["evenflow"]["time_to_target_s"] == pytest.approx(2.5)
    assert arms["group_by_length"]["time_to_target_s"] is None  # never reaches 4.5
    v = verdict(arms, load={"cores": 4, "load1_during": [1.5, 2.0]}, world_size=2)
    assert v["throughput_ratio"]["median"] == pytest.approx(2.0) and v["throughput_ratio"]["repeats"] == 5
    assert v["time_to_target_ratio"]["median"] == pytest.approx(0.25)
    assert v["critical_path_ratio"] == pytest.approx(2.0)
    assert v["best_fixed_arm"] == "fixed" and v["heldout_gap_vs_best_fixed"] == pytest.approx(-0.1)
    assert v["goals"] == {"heldout_within_0.03_of_best_fixed": True, "time_to_target_at_most_0.7x_fixed": True}
    assert v["warnings"] == [] and v["reliable"]


def test_verdict_reports_unmet_goals_and_warns_on_load():
    from evenflow.demo.report import add_time_to_target, verdict

    arms = {"fixed": _arm([10.0, 10.0, 5.0, 10.0, 10.0], [0, 100], [6.0, 4.5]),
            "evenflow": _arm([11.0, 9.0, 10.0, 12.0, 11.0], [0, 100], [6.0, 4.6])}
    add_time_to_target(arms)
    v = verdict(arms, load={"cores": 2, "load1_during": [2.2, 7.5]}, world_size=2)
    assert v["time_to_target_ratio"] is None and v["heldout_gap_vs_best_fixed"] == pytest.approx(0.1)
    assert v["goals"] == {"heldout_within_0.03_of_best_fixed": False, "time_to_target_at_most_0.7x_fixed": False}
    assert not v["reliable"] and any("load average reached 7.5" in w for w in v["warnings"])
    assert any("ranged 0.90-2.00x" in w for w in v["warnings"])


def test_table_states_goals_and_time_model():
    from evenflow.demo.render import format_table
    from evenflow.demo.report import add_time_to_target, summarize_arm, verdict

    rec = {"samples": 1, "real": 10, "padded": 10, "cpu_s": 0.1, "loss_tokens": 1, "loss_sum": 1.0}
    mix = {"fixed": {"H": 1.0, "H_g": 0.98, "late": 0.26, "q_cv": 0.05, "rough": 1.01},
           "evenflow": {"H": 0.5, "H_g": 0.71, "late": 0.24, "q_cv": 0.02, "rough": 0.08}}
    arms = {name: {**summarize_arm(_raw([_chunk(2, 1.0, h1), _chunk(2, 1.0, h2)], [[rec] * 4, [rec] * 4]), 6.0),
                   "composition": mix[name]}
            for name, h1, h2 in (("fixed", 5.0, 4.5), ("evenflow", 4.8, 4.52))}
    add_time_to_target(arms)
    v = verdict(arms, load={"cores": 2, "load1_during": [2.0]}, world_size=2)
    text = format_table(arms, v, batch_size=1, accumulation=4, lr_text="square-root scaling ...")
    for phrase in ("samples/s (median)", "held-out loss / token", "time to target (s)", "never",
                   "than fixed batching (median of 2 ABBA-interleaved rounds", "goal within 0.03: met",
                   "time to quality: evenflow never reached", "time model:", "x 4 accumulation",
                   "step mix H_g (<= 1: mixed)", "0.71", "longest tenth in last 1/4", "step composition (planned",
                   "step-to-step change, rough", "0.08"):
        assert phrase in text, phrase


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the demo extra)")
def test_loss_matches_masked_reference_and_backpropagates_empty_batches():
    import torch.nn.functional as F

    from evenflow.demo.train import build_model, sum_loss

    model = build_model(DemoConfig(hidden_size=32, intermediate_size=64, num_layers=1), 97)
    ids = torch.randint(1, 97, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    ids[1, 12:] = 0
    labels = ids.clone()
    labels[:, :5] = -100
    labels[mask == 0] = -100
    ref_logits = model(input_ids=ids, attention_mask=mask).logits
    ref = F.cross_entropy(ref_logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100,
                          reduction="sum")
    loss, n = sum_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert n == int((labels[:, 1:] != -100).sum())
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    empty, n = sum_loss(model, {"input_ids": ids, "labels": torch.full_like(ids, -100)})
    empty.backward()  # must not raise: DDP needs every rank to run backward
    assert n == 0 and empty.item() == 0.0
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the demo extra)")
def test_packed_batch_loss_equals_the_samples_one_by_one():
    """The summed arm is in the demo only because this holds: no attention across packed samples."""
    from evenflow.demo.train import build_model, sum_loss
    from evenflow.runtime import FlatCollate

    model = build_model(DemoConfig(hidden_size=32, intermediate_size=64, num_layers=2), 97)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (7, 12, 5, 9):
        ids = torch.randint(1, 97, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        samples.append({"input_ids": ids, "labels": labels})
    alone = [sum_loss(model, {k: v[None] for k, v in s.items()}) for s in samples]
    packed, n = sum_loss(model, FlatCollate()(samples))
    assert n == sum(t for _, t in alone)
    assert packed.item() == pytest.approx(sum(loss.item() for loss, _ in alone), rel=1e-5)
    shuffled = FlatCollate()([samples[2], samples[0], samples[3], samples[1]])
    assert sum_loss(model, shuffled)[0].item() == pytest.approx(packed.item(), rel=1e-5)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers (the demo extra)")
def test_group_by_length_deals_hf_order_round_robin():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from evenflow.demo.arms import _fixed_loader
    from evenflow.demo.plan import Matching

    class Data:
        lengths = np.array([5, 40, 7, 33, 12, 3, 28, 9, 17])
        train = [{"input_ids": torch.ones(int(n), dtype=torch.long), "labels": torch.ones(int(n), dtype=torch.long)}
                 for n in lengths]

    m = Matching(fixed_batch_size=1, accumulation=2, evenflow_steps=3, summed_steps=3, evenflow_samples_per_step=3,
                 fixed_steps=3, reference_tokens=10)
    cfg = DemoConfig(num_workers=0, seed=3)
    order = get_length_grouped_indices(Data.lengths.tolist(), 2, generator=torch.Generator().manual_seed(3))
    dealt = [[int(b["input_ids"].shape[1]) for b in _fixed_loader("group_by_length", Data, cfg, m, r)] for r in (0, 1)]
    padded = order + order[:1]  # 9 batches on 2 ranks: the short rank refills from the start (even_batches)
    assert dealt == [[int(Data.lengths[i]) for i in padded[r::2]] for r in (0, 1)]
