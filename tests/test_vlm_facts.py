"""The stock-model facts the VLM adapters rely on, re-checked on the installed transformers, and the traps: each
test computes the library's way and the wrong variant, and shows the first exact and the second off -- so the
test fails if the library ever takes the wrong variant. One process, tiny random-init models (float64 with the
stock float32 roundings lifted, see tests/vlm_scenarios.float64_throughout; the trap margins hold either way).
Also: the adapter's hostile inputs and the planner's cap, without any process group.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vlm_scenarios as sc
from evenflow import FlatCollate, PadCollate
from evenflow.errors import ExampleError
from evenflow.balance.phases import ExampleMeta, OrchestratorConfig, PhaseSpec, decode_metadata, encode_metadata, plan_step
from evenflow.vlm import QwenVLAdapter, VLMConfig, adapter_for, llm_batch

pytestmark = pytest.mark.timeout(300)
FAMILIES = ("qwen2_vl", "qwen2_5_vl")
EXACT = 1e-10


@pytest.fixture(scope="module", autouse=True)
def setup():
    with sc.one_thread_float64():
        yield


@pytest.fixture(scope="module")
def models():
    return {f: sc.tiny_model(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def samples():
    return [s for rank in sc.per_rank_samples() for s in rank]


@pytest.fixture(scope="module")
def references(models, samples):
    return {f: sc.reference(models[f], samples) for f in FAMILIES}


# -- fact 1: the vision tower ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_each_item_is_encoded_from_its_own_rows_and_its_grid(models, family):
    visual = adapter_for(models[family]).visual
    grid = torch.tensor([[1, 12, 16], [1, 8, 8], [2, 8, 12]])
    rows = torch.randn(int(grid.prod(-1).sum()), sc.PATCH, dtype=torch.float64)
    together = visual(rows, grid_thw=grid).pooler_output
    assert together.shape[0] == int((grid.prod(-1) // 4).sum())                  # t*h*w // 4 rows per item
    alone = [visual(rows[:192], grid_thw=grid[:1]).pooler_output, visual(rows[256:], grid_thw=grid[2:]).pooler_output]
    assert torch.equal(alone[0], together[:48]) and torch.equal(alone[1], together[64:])  # window attention too
    frames = visual(rows[256:], grid_thw=torch.tensor([[1, 8, 12], [1, 8, 12]])).pooler_output
    assert torch.equal(frames, alone[1])                                         # a video = its frames
    transposed = visual(rows[:192], grid_thw=torch.tensor([[1, 16, 12]])).pooler_output
    assert sc.rel(transposed, alone[0]) > 1e-6                                     # the grid is required
    with pytest.raises(Exception):                                               # fact 4: empty calls raise
        visual(rows[:0], grid_thw=grid[:0])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_encodes_zero_items_with_a_dummy_that_reaches_every_vision_parameter(models, family):
    model = models[family]
    adapter = adapter_for(model)
    out = adapter.encode("vision", torch.zeros(0, sc.PATCH, dtype=torch.float64), [],
                         torch.zeros(0, 4, dtype=torch.long))
    assert out.shape == (0, adapter.hidden_size)
    model.zero_grad(set_to_none=True)
    out.sum().backward()  # the graph reaches the tower: every vision parameter gets a gradient, exactly zero
    vision = [p for n, p in model.named_parameters() if ".visual." in n]
    assert vision and all(p.grad is not None and float(p.grad.abs().max()) == 0 for p in vision)
    model.zero_grad(set_to_none=True)


# -- fact 2: positions per example -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_positions_of_each_example_equal_the_batched_ones(models, samples, family):
    model = models[family]
    batch = PadCollate()(samples)
    kwargs = dict(mm_token_type_ids=batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
                  video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"])
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = batch["second_per_grid_ts"]
    batched, _ = model.model.get_rope_index(batch["input_ids"], **kwargs)
    for j, example in enumerate(QwenVLAdapter(model).find_items(batch)):
        n = example.input_ids.numel()
        assert torch.equal(example.token_fields["position_ids"], batched[:, j, :n].T), j


# -- fact 3 and the traps of fact 4 ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_decomposed_step_is_exact_and_packing_without_text_positions_is_not(models, samples, references,
                                                                                family, layout):
    model = models[family]
    ref_loss, ref = references[family]
    adapter, llm, batch = sc.local_llm(model, samples, layout)
    T = sc.supervised(samples)
    loss = sc.targets_loss(adapter.forward(model, llm, batch), batch.targets) / T
    assert abs(float(loss.detach()) - ref_loss) <= EXACT * ref_loss
    assert sc.rel_err(sc.grads_of(model, loss), ref) <= EXACT
    if layout == "packed":
        # Trap: the 3 M-RoPE rows alone ([3, 1, N]) -- the examples attend to each other, silently.
        _, llm, batch = sc.local_llm(model, samples, layout)
        images = torch.split(llm.media["vision"], llm.media_item_rows["vision"])
        kinds = llm.media_item_meta["vision"][:, 0].tolist()
        merged = {name: sc.pooled([y for y, k in zip(images, kinds) if k == kind], llm.media["vision"])
                  for name, kind in (("image", 0), ("video", 1))}
        wrong = model(input_ids=batch.input_ids, position_ids=batch.fields["position_ids"].permute(2, 0, 1),
                      mm_encoder_outputs=merged, use_cache=False).logits
        bad = sc.targets_loss(wrong, batch.targets) / T
        assert sc.rel_err(sc.grads_of(model, bad), ref) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_without_position_ids_fall_back_silently(models, samples, references, family):
    """Trap: merged embeddings without position_ids -> 1-D positions plus a cached rope_deltas, no error."""
    model = models[family]
    batch = PadCollate()(samples)
    inputs = sc.model_inputs(batch)
    ref_logits = model(**{**inputs, "pixel_values": inputs["pixel_values"].double(),
                          "pixel_values_videos": inputs["pixel_values_videos"].double()}, use_cache=False).logits
    embeds = model.get_input_embeddings()(batch["input_ids"])
    for kind, rows_key, grid_key, token in (("image", "pixel_values", "image_grid_thw", sc.IMAGE_ID),
                                            ("video", "pixel_values_videos", "video_grid_thw", sc.VIDEO_ID)):
        y = model.model.visual(batch[rows_key].double(), grid_thw=batch[grid_key]).pooler_output
        embeds = embeds.masked_scatter((batch["input_ids"] == token)[..., None], y)
    wrong = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], use_cache=False).logits
    mask = batch["attention_mask"].bool()
    assert sc.rel(wrong[mask], ref_logits[mask]) > 1e-4
    adapter, llm, lb = sc.local_llm(model, samples, "padded")
    ours = adapter.forward(model, llm, lb)
    assert sc.rel(ours[mask], ref_logits[mask]) <= EXACT


@pytest.mark.parametrize("family", FAMILIES)
def test_without_mm_token_type_ids_qwen2_5_silently_drops_mrope_and_qwen2_raises(models, samples, references,
                                                                                 family):
    model = models[family]
    ref_loss, _ = references[family]
    batch = PadCollate()(samples)
    inputs = {k: v for k, v in sc.model_inputs(batch).items() if k != "mm_token_type_ids"}
    inputs["pixel_values"], inputs["pixel_values_videos"] = (inputs["pixel_values"].double(),
                                                             inputs["pixel_values_videos"].double())
    if family == "qwen2_vl":
        with pytest.raises(ValueError, match="mm_token_type_ids"):
            model(**inputs, use_cache=False)
    else:
        wrong = sc.loss_sum(model(**inputs, use_cache=False).logits, batch["labels"]) / sc.supervised(samples)
        assert abs(float(wrong.detach()) - ref_loss) > 1e-6 * ref_loss
    # The adapter derives the types from the placeholders: a batch without them is still exact ...
    stripped = [{k: v for k, v in s.items() if k != "mm_token_type_ids"} for s in samples]
    adapter, llm, lb = sc.local_llm(model, stripped, "padded")
    loss = sc.targets_loss(adapter.forward(model, llm, lb), lb.targets) / sc.supervised(samples)
    assert abs(float(loss.detach()) - ref_loss) <= EXACT * ref_loss
    # ... and one whose types disagree with them is refused, naming the example.
    wrong_types = copy.deepcopy(samples)
    wrong_types[1]["mm_token_type_ids"] = torch.zeros_like(wrong_types[1]["mm_token_type_ids"])
    with pytest.raises(ExampleError, match="example 1 .*mm_token_type_ids"):
        QwenVLAdapter(model).find_items(PadCollate()(wrong_types), sample_ids=[7, 8, 9, 10, 11, 12])


def test_hf_labels_loss_is_a_float32_mean_per_call(models, samples, references):
    """Trap: ``labels=`` gives a per-call float32 mean; summed per rank it is neither float64 nor the global
    mean. The library sums token losses in the model's dtype and divides by the global count."""
    model = models["qwen2_vl"]
    ref_loss, _ = references["qwen2_vl"]
    parts = [samples[:3], samples[3:]]
    means = []
    for part in parts:
        inputs = sc.model_inputs(PadCollate()(part))
        for key in ("pixel_values", "pixel_values_videos"):
            if key in inputs:
                inputs[key] = inputs[key].double()
        out = model(**inputs, labels=PadCollate()(part)["labels"], use_cache=False)
        assert out.loss.dtype == torch.float32 and out.logits.dtype == torch.float64
        means.append(float(out.loss.detach()))
    assert abs(float(np.mean(means)) - ref_loss) > 1e-3 * ref_loss            # mean of means != global mean
    weighted = sum(m * sc.supervised(p) for m, p in zip(means, parts)) / sc.supervised(samples)
    assert EXACT * ref_loss < abs(weighted - ref_loss) < 1e-5 * ref_loss      # right weights, float32 rounding


# -- the adapter on hostile batches ----------------------------------------------------------------------------
def _batch(samples, changes):
    bad = copy.deepcopy(samples)
    for (j, key), value in changes.items():
        bad[j][key] = value
    return bad


@pytest.mark.parametrize("case, match", [
    ("grid_vs_placeholders",
     r"example 0 of this rank.s batch \(dataset index 40\).*grid \(1, 8, 8\).*placeholder run has 24"),
    ("grid_not_mergeable", r"example 0 .*grid \(1, 3, 32\).*multiples of spatial_merge_size=2"),
    ("missing_grid", r"example 1 .*image 1 .*has only 2 grids"),
])
def test_find_items_refuses_media_that_do_not_match_their_placeholders(models, samples, case, match):
    rank0 = sc.per_rank_samples()[0]
    if case == "grid_vs_placeholders":      # 64 rows -> 16 tokens; the image has 24 placeholders
        bad = _batch(rank0, {(0, "image_grid_thw"): torch.tensor([[1, 8, 8]]),
                             (0, "pixel_values"): torch.randn(64, sc.PATCH)})
    elif case == "grid_not_mergeable":
        bad = _batch(rank0, {(0, "image_grid_thw"): torch.tensor([[1, 3, 32]])})
    else:                                   # sample 1's second image loses its grid and rows
        bad = _batch(rank0, {(1, "image_grid_thw"): torch.tensor([[1, 12, 8]]),
                             (1, "pixel_values"): rank0[1]["pixel_values"][:96]})
    with pytest.raises(ExampleError, match=match):
        QwenVLAdapter(models["qwen2_vl"]).find_items(PadCollate()(bad), sample_ids=[40, 41, 42])


def test_find_items_refuses_rows_left_over_after_every_placeholder(models):
    rank0 = sc.per_rank_samples()[0]
    batch = PadCollate()(rank0)
    batch["pixel_values"] = torch.cat([batch["pixel_values"], torch.zeros(4, sc.PATCH)])
    with pytest.raises(ExampleError, match="a grid does not match its rows"):
        QwenVLAdapter(models["qwen2_vl"]).find_items(batch)


def test_packed_batches_split_at_position_restarts_and_drop_the_padding_tail(models, samples):
    padded = QwenVLAdapter(models["qwen2_vl"]).find_items(PadCollate()(samples))
    flat = FlatCollate(pad_to_multiple_of=64)(samples)
    packed = QwenVLAdapter(models["qwen2_vl"]).find_items(flat, samples=len(samples))
    assert len(packed) == len(padded) == len(samples)
    for a, b in zip(padded, packed):
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.token_fields["position_ids"], b.token_fields["position_ids"])
        assert [t.shape for t in a.media["vision"]] == [t.shape for t in b.media["vision"]]


def test_video_slices_are_items_of_one_temporal_patch_each(models):
    rank0 = sc.per_rank_samples()[0]
    whole = QwenVLAdapter(models["qwen2_vl"]).find_items(PadCollate()(rank0))
    sliced = QwenVLAdapter(models["qwen2_vl"], VLMConfig(video_slice=1)).find_items(PadCollate()(rank0))
    assert whole[2].media_meta["vision"] == [(1, 3, 4, 8)]
    assert sliced[2].media_meta["vision"] == [(1, 1, 4, 8)] * 3
    assert torch.equal(torch.cat(sliced[2].media["vision"]), whole[2].media["vision"][0])
    assert torch.equal(sliced[2].token_fields["position_ids"], whole[2].token_fields["position_ids"])


def test_an_llm_batch_without_examples_is_one_dummy_token():
    from evenflow.exchange import LLMInputs

    empty = LLMInputs(example_ids=[], input_ids=[], labels=[], media={}, media_counts={}, total_loss_tokens=5,
                      token_fields={"position_ids": []})
    for layout in ("packed", "padded"):
        b = llm_batch(empty, layout, field_widths={"position_ids": 3})
        assert b.dummy and b.input_ids.shape == (1, 1) and b.fields["position_ids"].shape == (1, 1, 3)
        assert int((b.targets != -100).sum()) == 0


# -- the planner's side ----------------------------------------------------------------------------------------
def test_item_metadata_round_trips_through_the_exchange_format():
    metas = [ExampleMeta(9, 4, ((8, 4),), (((0, 1, 2, 4), (1, 1, 2, 2)),)), ExampleMeta(3, 1, ((),), ((),))]
    flat = encode_metadata(metas, 1, meta_widths=[4])
    assert decode_metadata(np.concatenate([flat, np.zeros(5, np.int64)]), 1, meta_widths=[4]) == metas
    with pytest.raises(ValueError, match="meta_width"):
        encode_metadata([ExampleMeta(9, 4, ((8,),), (((0, 1),),))], 1, meta_widths=[4])


def test_the_row_cap_keeps_every_rank_within_its_budget():
    """LPT by cost alone puts 256 rows on one rank (many small images); the cap keeps every rank <= 200."""
    spec = dict(cost=__import__("evenflow").balance.QuadraticCost(alpha=0, beta=1), input_dim=4)
    meta = [[ExampleMeta(4, 1, ((128, 64),))], [ExampleMeta(4, 1, ((16,) * 12,))], [ExampleMeta(4, 1, ((100,),))]]

    def held(cap):
        cfg = OrchestratorConfig(encoders={"vision": PhaseSpec(**spec, max_rows_per_rank=cap)})
        it = plan_step(meta, cfg).items["vision"]
        return np.bincount(it.dest, weights=it.rows, minlength=3)

    assert held(None).max() > 200
    assert held(200).max() <= 200
    with pytest.raises(ValueError, match=r"rank 0 holds 192 input rows.*max_encoder_rows=100"):
        held(100)


def test_the_plan_reports_its_imbalance_against_the_indivisible_bound():
    cfg = OrchestratorConfig(encoders={"vision": PhaseSpec(input_dim=4)})
    plan = plan_step([[ExampleMeta(6, 3, ((40, 4),))], [ExampleMeta(6, 3, ((),))], [ExampleMeta(6, 3, ((),))]], cfg)
    v = plan.imbalance()["vision"]
    assert v.before == pytest.approx(3.0) and v.bound == pytest.approx(40 / (44 / 3))
    assert v.after == pytest.approx(v.bound)   # the big image alone on one rank is the best any plan does
