"""The demo's parts, each against a hand-computed answer: the arms' steps (HF, group_by_length, TRL's packs), the
dry run, the ABBA chunks, the losses (padded, packed, the per-sequence attention), the one throughput figure,
time to target, the replay's verdict and the printed table. The quick run end to end is in test_readme.py."""

from __future__ import annotations

import doctest
import importlib.util

import numpy as np
import pytest
import torch

from evenflow.demo import ARMS, REFERENCE, DemoConfig, quick_config, schedule_factor

HAS_HF = importlib.util.find_spec("transformers") is not None
HAS_TRL = HAS_HF and importlib.util.find_spec("trl") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers (the demo extra)")
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="needs trl (the trl extra)")


def test_doctests():
    import evenflow.demo.replay as replay
    import evenflow.demo.report as report
    import evenflow.demo.steps as steps
    import evenflow.demo.train as train
    for module in (report, train, steps, replay):
        assert doctest.testmod(module).failed == 0, module.__name__
    if HAS_HF:
        import evenflow.demo.attention as attention
        assert doctest.testmod(attention).failed == 0


@pytest.mark.parametrize("bad", [dict(arms=("evenflow",)), dict(arms=("hf_default", "x")),
                                 dict(arms=("hf_default", "evenflow", "hf_default")), dict(rounds=0),
                                 dict(warmup_fraction=1.0), dict(final_lr_fraction=0.0), dict(reference_tokens=0),
                                 dict(token_budget=100), dict(base_lr=float("nan"))])
def test_config_refuses(bad):
    with pytest.raises(ValueError):
        DemoConfig(**bad)


def test_the_five_arms_run_in_make_demo_and_quick():
    assert ARMS == ("hf_default", "group_by_length", "trl_packing", "evenflow", "evenflow_summed")
    assert DemoConfig().arms == ARMS == quick_config().arms and REFERENCE == "hf_default"
    assert quick_config().rounds >= 5 and quick_config().train_samples < DemoConfig().train_samples


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


# -- the arms' steps ---------------------------------------------------------------------------------------------

def test_hf_steps_by_hand():
    from evenflow.demo import steps

    parts = steps.matched_random_steps(10, 3, seed=0)
    assert [len(p) for p in parts] == [4, 3, 3] and sorted(np.concatenate(parts).tolist()) == list(range(10))
    # micro-batches of 2 dealt round-robin: batch k of a step to rank k mod 2; a short rank gets fewer
    assert steps.deal([np.array([1, 2, 3, 4, 5])], 2, 2) == [[[[1, 2], [5]], [[3, 4]]]]
    lengths = np.array([100, 100, 100, 100, 100, 100, 100, 500])
    # 4 x 100 fits 500, but any batch holding the 500-token sample pads to 500 x its size: only batch 1 fits
    assert steps.largest_batch_size(lengths, 2, token_budget=500, world_size=2, seed=0) == 1
    assert steps.largest_batch_size(lengths[:-1], 1, token_budget=400, world_size=2, seed=0) == 4
    assert steps.peak_tokens([[[[0, 7]], []]], lengths) == 1000
    assert steps.peak_tokens([[[[0, 7]], []]], lengths, "summed") == 600
    # 1,000 samples, 117 steps, batch 1, 2 ranks: 4.27 samples per rank -> a user sets 4 (125 steps)
    assert steps.hf_accumulation(1000, 117, 1, 2) == 4


@needs_hf
def test_length_grouped_steps_are_hfs_order_cut_into_steps():
    from transformers.trainer_pt_utils import get_length_grouped_indices

    from evenflow.demo import steps

    lengths = np.random.default_rng(1).integers(5, 300, 90)
    order = get_length_grouped_indices(lengths.tolist(), 8, generator=torch.Generator().manual_seed(3))
    parts = steps.length_grouped_steps(lengths, 11, 8, seed=3)
    assert np.concatenate(parts).tolist() == order and len(parts) == 11


@needs_trl
def test_trl_packs_are_pack_datasets_own():
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    from evenflow.demo import steps

    lengths = np.random.default_rng(2).integers(1, 60, 40)
    packs = steps.trl_packs(lengths, 100)
    # TRL on real-looking token columns: the same rows, sample by sample (token j of sample i is 1000 i + j)
    real = pack_dataset(Dataset.from_dict({"input_ids": [[1000 * i + j for j in range(n)] for i, n in
                                                         enumerate(lengths)]}), 100, strategy="bfd")
    assert [[int(row["input_ids"][s]) // 1000 for s in np.cumsum([0, *row["seq_lengths"][:-1]])]
            for row in real] == packs
    assert sorted(i for p in packs for i in p) == list(range(40)) and max(lengths[p].sum() for p in packs) <= 100
    plan = steps.pack_steps(packs, 2, seed=0)
    assert len(plan) == -(-len(packs) // 2) and all(len(step) == 2 for step in plan)
    assert sorted(tuple(mb) for step in plan for rank in step for mb in rank) == sorted(map(tuple, packs))
    if len(packs) % 2:
        assert plan[-1][1] == []  # the last step's second rank is IDLE
    with pytest.raises(ValueError, match="would truncate"):
        steps.trl_packs(np.array([150]), 100)


@needs_trl
def test_dry_run_plans_every_arm():
    from evenflow.demo.plan import match_arms
    from evenflow.planning import GroupingConfig
    from evenflow.sim import global_schedule

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 400).astype(np.int64), 8, 1024)
    lengths[0] = 1024
    cfg = DemoConfig(train_samples=400, cutoff=1024, token_budget=1024)
    m = match_arms(cfg, lengths, loss_tokens=lengths // 2)
    steps = global_schedule(lengths, world_size=2, grouping=GroupingConfig(token_budget=1024)).num_steps
    assert m.planning == "global" and m.evenflow_steps == steps and m.batch_size == 1
    assert m.hf_accumulation == round(400 / steps / 2) and m.hf_integer_steps == -(-200 // m.hf_accumulation)
    # the HF arms take exactly evenflow's steps (the issue asks +-1 %); the summed arms pack at least as tightly
    assert m.arms["hf_default"].optimizer_steps == m.arms["group_by_length"].optimizer_steps == steps
    assert m.arms["evenflow_summed"].optimizer_steps <= steps and m.arms["trl_packing"].layout == "summed"
    for name, plan in m.arms.items():
        trained = sorted(i for step in plan.per_rank for rank in step for mb in rank for i in mb)
        assert trained == list(range(400)), name  # every sample exactly once
        assert plan.peak_tokens <= 1024, name
        assert len(plan.per_rank) == plan.optimizer_steps and set(plan.composition) >= {"H_g", "late", "rough"}
    lo, hi = m.arms["hf_default"].micro_batches_range
    assert hi - lo <= 1 and lo <= 400 / steps / 2 <= hi
    assert m.arms["group_by_length"].composition["H_g"] > 1.5 > m.arms["hf_default"].composition["H_g"]
    assert m.reference_tokens == round(int((lengths // 2).sum()) / steps)
    assert "per_rank" not in m.as_dict()["arms"]["evenflow"]


# -- losses and attention --------------------------------------------------------------------------------------

@needs_hf
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


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, 97, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


@needs_trl
def test_packed_rows_lose_what_the_samples_lose_one_by_one():
    """TRL's row and evenflow's are the same row; its loss is the samples' one by one, under stock sdpa (a dense
    block-diagonal mask) and under the demo's per-sequence attention, gradients included."""
    from evenflow.demo.arms import TrlPackCollate
    from evenflow.demo.attention import register
    from evenflow.demo.train import build_model, sum_loss
    from evenflow.runtime import FlatCollate, PadCollate

    cfg = DemoConfig(hidden_size=32, intermediate_size=64, num_layers=2)
    samples = _samples((7, 12, 5, 9))
    trl, flat = TrlPackCollate()(samples), FlatCollate()(samples)
    assert all(torch.equal(trl[k], flat[k]) for k in ("input_ids", "labels", "position_ids"))
    stock, segments = build_model(cfg, 97), build_model(cfg, 97, attention=register())
    alone = [sum_loss(stock, {k: v[None] for k, v in s.items()}) for s in samples]
    for batch in (trl, PadCollate(pad_token_id=0)(samples)):
        (a, n), (b, m) = sum_loss(stock, batch), sum_loss(segments, batch)
        assert n == m == sum(t for _, t in alone)
        assert a.item() == pytest.approx(sum(x.item() for x, _ in alone), rel=1e-5) and b.item() == pytest.approx(
            a.item(), rel=1e-5)
        stock.zero_grad()
        segments.zero_grad()
        a.backward()
        b.backward()
        for p, q in zip(stock.parameters(), segments.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@needs_hf
def test_segment_attention_refuses_a_mask():
    from evenflow.demo.attention import segment_causal_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="no mask"):
        segment_causal_attention(None, q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))


@needs_hf
def test_planned_windows_follow_the_plan_and_fill_an_empty_rank_with_idle(tmp_path):
    """A rank's share of a step, in micro-batches, and an IDLE placeholder where it has none; the window's
    token count is the step's supervised tokens (one rank here: the all_reduce is the identity)."""
    import torch.distributed as dist

    from evenflow.demo.arms import _planned_windows
    from evenflow.runtime import PadCollate

    class Data:
        train = _samples((6, 9, 4))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        windows = list(_planned_windows([[[0, 1], [2]], []], Data, DemoConfig(num_workers=0),
                                        PadCollate(pad_token_id=0)))
    finally:
        dist.destroy_process_group()
    assert [len(w.micros) for w in windows] == [2, 1] and windows[1].micros[0].idle
    assert [m.samples for m in windows[0].micros] == [2, 1] and windows[0].global_samples == 3
    assert windows[0].global_tokens == sum(int((s["labels"][1:] != -100).sum()) for s in Data.train)
    assert windows[1].global_tokens == windows[1].global_samples == 0


# -- metrics, time to target, verdict ---------------------------------------------------------------------------

def _chunk(samples, wall, heldout, real_tokens=None):
    tokens = 60 * samples if real_tokens is None else real_tokens
    return {"samples": samples, "wall_s": wall, "heldout": heldout, "steps": 1, "load1": 1.0, "real_tokens": tokens}


def _rec(step, samples, real, padded, cpu):
    return {"step": step, "samples": samples, "real": real, "padded": padded, "cpu_s": cpu, "loss_tokens": 1,
            "loss_sum": 1.0}


def _raw(chunks, records, lrs=(1e-3,)):
    return {"chunks": chunks, "per_rank_steps": records, "optimizer_steps": len(lrs), "planned_steps": len(lrs),
            "lrs": list(lrs)}


def test_summarize_arm_metrics():
    from evenflow.demo.report import summarize_arm

    # rank 0 takes 2 micro-batches in step 0 and rank 1 one (8 or 9 samples dealt to 2 ranks): still aligned
    records = [[_rec(0, 1, 40, 50, 0.4), _rec(0, 1, 50, 50, 0.6), _rec(1, 1, 50, 50, 0.5)],
               [_rec(0, 1, 100, 100, 2.0), _rec(1, 0, 0, 0, 0.1)]]
    raw = _raw([_chunk(2, 1.0, 5.0, 120), _chunk(2, 0.5, 4.0, 120), _chunk(0, 0.1, 4.0, 0)], records, lrs=(1, 2))
    s = summarize_arm(raw, initial_heldout=6.0)
    assert (s["samples"], s["real_tokens"], s["padded_tokens"], s["peak_tokens"]) == (4, 240, 250, 100)
    assert s["tokens_per_s_per_round"] == [120.0, 240.0]  # an empty chunk is no throughput sample
    assert s["tokens_per_s"] == 180.0 and (s["tokens_per_s_min"], s["tokens_per_s_max"]) == (120.0, 240.0)
    assert s["mean_rank_imbalance"] == pytest.approx((1.0 + 50 / 25) / 2)  # steps cost [100, 100] then [50, 0]
    assert s["critical_path_cpu_s"] == pytest.approx(2.0 + 0.5) and s["idle_batches"] == 1
    assert s["micro_batches_per_rank"] == 2.5
    assert s["curve"]["real_tokens"] == [0, 120, 240, 240] and s["curve"]["heldout_loss"] == [6.0, 5.0, 4.0, 4.0]
    assert s["curve"]["seconds"] == pytest.approx([0, 120 / 180, 240 / 180, 240 / 180])
    assert s["heldout_loss"] == 4.0
    raw["per_rank_steps"][1].pop()
    with pytest.raises(ValueError, match="not aligned"):
        summarize_arm(raw, initial_heldout=6.0)


def _arm(rate, tokens, losses):
    return {"tokens_per_s": rate, "heldout_loss": losses[-1], "curve": {"real_tokens": tokens, "heldout_loss": losses}}


def _comparison(arm, ci=None, seeds=20, reason=""):
    from evenflow.demo.replay import Comparison, word
    return Comparison(arm, arm, seeds, None if ci is None else sum(ci) / 2, ci,
                      "no interval" if ci is None else word(ci), reason).as_dict()


def test_time_to_target_and_verdict_by_hand():
    from evenflow.demo.report import add_time_to_target, verdict

    arms = {"hf_default": _arm(10.0, [0, 50, 100], [6.0, 5.0, 4.5]),
            "group_by_length": _arm(12.0, [0, 50, 100], [6.0, 5.1, 4.6]),
            "evenflow": _arm(20.0, [0, 50, 100], [6.0, 4.5, 4.4])}
    assert add_time_to_target(arms) == 4.5
    assert arms["hf_default"]["time_to_target_s"] == pytest.approx(10.0)  # its whole epoch: 100 tokens at 10/s
    assert arms["evenflow"]["tokens_to_target"] == pytest.approx(50.0)
    assert arms["evenflow"]["time_to_target_s"] == pytest.approx(2.5)
    assert arms["group_by_length"]["time_to_target_s"] is None  # never reaches 4.5
    comparisons = {"group_by_length": _comparison("group_by_length", (0.01, 0.03)),
                   "evenflow": _comparison("evenflow", (-0.01, 0.02))}
    v = verdict(arms, comparisons, load={"cores": 4, "load1_during": [1.5, 2.0]}, world_size=2, rows_commit="abc")
    assert v["arms"]["evenflow"]["speed_vs_reference"] == pytest.approx(2.0)
    assert v["arms"]["evenflow"]["time_to_target_vs_reference"] == pytest.approx(0.25)
    assert v["arms"]["evenflow"]["heldout_gap_this_run"] == pytest.approx(-0.1)
    assert v["arms"]["group_by_length"]["replay"]["verdict"] == "worse" and v["arms"]["hf_default"]["replay"] is None
    assert v["warnings"] == [] and v["reliable"]
    v = verdict(arms, comparisons, load={"cores": 2, "load1_during": [2.2, 7.5]}, world_size=2, rows_commit="abc")
    assert not v["reliable"] and any("load average reached 7.5" in w for w in v["warnings"])


def _rows(diffs, ref=5.0, arm="default_smooth", steps=117, fingerprint=None):
    rows = []
    for seed, d in enumerate(diffs):
        rows.append({"data": "chitchat", "arm": "fixed_matched", "seed": seed, "heldout_loss": ref + seed * 0.01,
                     "optimizer_steps": steps})
        rows.append({"data": "chitchat", "arm": arm, "seed": seed, "heldout_loss": ref + seed * 0.01 + d,
                     "optimizer_steps": steps, **({"schedule": fingerprint} if fingerprint else {})})
    return rows


def test_replay_verdict_follows_the_interval_or_says_there_is_none():
    from evenflow.demo.replay import MIN_SEEDS, compare, paired_interval

    own = {"evenflow": {"fingerprint": "f00", "steps": 117}, "hf_default": {"fingerprint": "baa", "steps": 117}}
    cfg = DemoConfig()
    noise = np.random.default_rng(0).normal(0, 0.01, MIN_SEEDS)
    for shift, expected in ((-0.03, "better"), (0.03, "worse"), (0.0, "within noise")):
        c = compare("evenflow", _rows(noise + shift), cfg, own=own)
        assert c.verdict == expected and c.seeds == MIN_SEEDS
        assert c.ci95 == pytest.approx(paired_interval(noise + shift))
        assert c.mean == pytest.approx(float(np.mean(noise + shift)))
    few = compare("evenflow", _rows(noise[:-1] - 0.03), cfg, own=own)
    assert (few.verdict, few.ci95, few.seeds) == ("no interval", None, MIN_SEEDS - 1) and "< 16" in few.reason
    stale = compare("evenflow", _rows(noise - 0.03, fingerprint="0ld"), cfg, own=own)
    assert stale.verdict == "no interval" and "not the steps evenflow trains today" in stale.reason
    moved = compare("evenflow", _rows(noise - 0.03, steps=118), cfg, own=own)
    assert moved.verdict == "no interval"
    assert compare("evenflow", _rows(noise - 0.03, fingerprint="f00"), cfg, own=own).verdict == "better"
    rows = _rows(noise - 0.03)
    for r in rows[1::2]:
        r["revision"] = "abc+dirty"  # the new arm's rows carry theirs; the reference's predate the field
    assert compare("evenflow", rows, cfg, own=own).revisions == ("abc+dirty", "unrecorded")
    other = compare("evenflow", _rows(noise - 0.03), quick_config(), own=own)
    assert other.verdict == "no interval" and "not the replay's" in other.reason
    assert compare("evenflow", [], cfg, own=own).reason.startswith("no replay rows")
    assert compare("evenflow_summed", _rows(noise), DemoConfig(lr_scaling="sqrt"), own=own).verdict == "no interval"


def test_table_has_every_arm_and_at_most_five_verdict_lines():
    from evenflow.demo.plan import ArmPlan, Matching
    from evenflow.demo.render import format_table
    from evenflow.demo.report import add_time_to_target, summarize_arm, verdict

    records = [[_rec(0, 1, 10, 10, 0.1)] * 2, [_rec(0, 1, 10, 10, 0.1)] * 2]
    arms = {name: summarize_arm(_raw([_chunk(2, 1.0, h1, 20), _chunk(2, 1.0, h2, 20)], records), 6.0)
            for name, h1, h2 in (("hf_default", 5.0, 4.5), ("trl_packing", 4.8, 4.52), ("evenflow", 4.6, 4.4))}
    add_time_to_target(arms)
    comparisons = {"trl_packing": _comparison("trl_packing", seeds=8, reason="8 paired seeds < 16"),
                   "evenflow": _comparison("evenflow", (-0.02, 0.01), seeds=32)}
    v = verdict(arms, comparisons, load={"cores": 2, "load1_during": [9.0]}, world_size=2, rows_commit="abc1234")
    plan = ArmPlan(optimizer_steps=1, layout="padded", micro_batches_per_step=4.27, micro_batches_range=(4, 5),
                   peak_tokens=10, fingerprint="x", composition={})
    m = Matching(batch_size=1, hf_accumulation=4, hf_integer_steps=125, evenflow_steps=117, reference_tokens=10,
                 planning="global", arms={name: plan for name in arms})
    text = format_table(arms, v, m, rounds=2, token_budget=4096)
    lines = text.splitlines()
    assert len(lines) == 2 + 12 + 1 + 5  # header, rule, 12 rows, rule, 5 verdict lines (one a warning)
    for phrase in ("HF default", "TRL packing", "optimizer steps", "peak tokens per micro-batch",
                   "real tokens/s (median, 2 rounds)", "min-max over the rounds", "  vs HF default", "1.00x",
                   "within noise", "no interval", "(8 seeds)", "[-0.020, +0.010]", "4-5 micro-batches",
                   "HF's integer accumulation 4 would take 125", "not SFTTrainer", "rows of commit abc1234",
                   "TRL packing no interval (8 paired seeds < 16)", "evenflow within noise (-0.005 [-0.020, +0.010], "
                   "32 seeds)", "time to HF default's final held-out loss 4.500", "WARNING: load average reached 9.0"):
        assert phrase in text, phrase
