"""The stock facts the Qwen2.5-Omni thinker and Qwen3-VL adapters rely on, re-checked on the installed transformers,
each beside the wrong variant (so the test fails if the library ever takes it). One process, tiny random-init
models, float64 with the stock float32 roundings lifted (tests/vlm_scenarios.float64_throughout).

Omni: the audio tower's output lengths (not ``frames // 4``), clips encoded independently, exact cuts at
``2 * n_window`` frames (and not at ``n_window``, nor at ``2 * n_window`` when ``n_window`` is odd), the parameter
its forward never uses, positions per example, the adapter's own audio merge. Qwen3-VL: deepstack rows per item,
a video as its frames, positions per example, and the merge splitting the deepstack columns back.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vlm_scenarios as sc
from evenflow import FlatCollate, PadCollate
from evenflow.errors import ExampleError
from evenflow.vlm import Qwen3VLAdapter, QwenOmniAdapter, VLMConfig, adapter_for, audio_output_rows

pytestmark = pytest.mark.timeout(300)
FAMILIES = ("qwen2_5_omni", "qwen3_vl")
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
    return {f: [s for rank in sc.per_rank_samples(family=f) for s in rank] for f in FAMILIES}


@pytest.fixture(scope="module")
def references(models, samples):
    return {f: sc.reference(models[f], samples[f]) for f in FAMILIES}


def _audio_tower(n_window: int):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniAudioEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    config = Qwen2_5OmniAudioEncoderConfig(num_mel_bins=sc.N_MELS, encoder_layers=1, encoder_attention_heads=2,
                                           encoder_ffn_dim=32, d_model=16, n_window=n_window, output_dim=32,
                                           max_source_positions=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5OmniAudioEncoder(config).double()


# -- the Omni thinker's audio tower -----------------------------------------------------------------------------
def test_audio_output_rows_follow_the_stock_rule_not_frames_over_four(models):
    tower = models["qwen2_5_omni"].model.audio_tower
    frames = np.arange(1, 400)
    _, stock = tower._get_feat_extract_output_lengths(torch.from_numpy(frames))
    assert np.array_equal(audio_output_rows(frames), stock.numpy())
    assert audio_output_rows(np.array([35]))[0] == 9 and 35 // 4 == 8       # the wrong rule is one row short
    feats = torch.randn(sc.N_MELS, 35, dtype=torch.float64)
    assert tower(feats, feature_lens=torch.tensor([35])).last_hidden_state.shape[0] == 9


def test_clips_are_encoded_independently(models):
    tower = models["qwen2_5_omni"].model.audio_tower
    lens = [37, 16, 50, 35]
    feats = torch.randn(sc.N_MELS, sum(lens), dtype=torch.float64)
    together = tower(feats, feature_lens=torch.tensor(lens)).last_hidden_state
    rows = audio_output_rows(np.array(lens)).tolist()
    alone = [tower(x, feature_lens=torch.tensor([x.shape[1]])).last_hidden_state for x in feats.split(lens, dim=1)]
    assert sc.rel(torch.cat(alone), together) <= EXACT and [a.shape[0] for a in alone] == rows


@pytest.mark.parametrize("n_window", [8, 5])
def test_a_long_clip_cuts_exactly_at_the_towers_windows_and_nowhere_else(n_window):
    """NOTE [ Exact audio cuts ]: pieces at multiples of 2 * n_window frames (4 * n_window when it is odd) encode
    to exactly the whole clip's rows; pieces cut at n_window, or at 2 * n_window for an odd n_window, do not."""
    tower = _audio_tower(n_window)
    feats = torch.randn(sc.N_MELS, 71, dtype=torch.float64)
    whole = tower(feats, feature_lens=torch.tensor([71])).last_hidden_state

    def cut(step):
        lens = [step] * (71 // step) + ([71 % step] if 71 % step else [])
        return tower(feats, feature_lens=torch.tensor(lens)).last_hidden_state

    exact = 2 * n_window * (1 if n_window % 2 == 0 else 2)
    assert sc.rel(cut(exact), whole) <= EXACT
    for wrong in (n_window, 2 * n_window) if n_window % 2 else (n_window,):
        pieces = cut(wrong)
        assert pieces.shape != whole.shape or sc.rel(pieces, whole) > 1e-3


def test_the_thinker_never_uses_audio_bos_eos_token_and_the_adapter_says_so(models, references):
    _, ref = references["qwen2_5_omni"]
    model = models["qwen2_5_omni"]
    never = [n for n, p in model.named_parameters() if float(ref[n].abs().max()) == 0]
    assert never == ["model.audio_tower.audio_bos_eos_token.weight"]
    assert QwenOmniAdapter(model).unused_parameters() == never


# -- positions ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_positions_of_each_example_equal_the_batched_ones(models, samples, family):
    model = models[family]
    batch = PadCollate()(samples[family])
    if family == "qwen2_5_omni":
        batched, _ = model.model.get_rope_index(
            batch["input_ids"], batch["image_grid_thw"], batch["video_grid_thw"], batch["attention_mask"], False,
            batch["feature_attention_mask"].sum(-1), batch["second_per_grid_ts"])
    else:
        batched, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                                batch["image_grid_thw"], batch["video_grid_thw"],
                                                batch["attention_mask"])
    for j, example in enumerate(adapter_for(model).find_items(batch)):
        n = example.input_ids.numel()
        assert torch.equal(example.token_fields["position_ids"], batched[:, j, :n].T), j


# -- the decomposed step, and the wrong merges -------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_decomposed_step_is_exact(models, samples, references, family, layout):
    model = models[family]
    ref_loss, ref = references[family]
    adapter, llm, batch = sc.local_llm(model, samples[family], layout, video_slice=1, audio_slice=1)
    loss = sc.targets_loss(adapter.forward(model, llm, batch), batch.targets) / sc.supervised(samples[family])
    assert abs(float(loss.detach()) - ref_loss) <= EXACT * ref_loss
    assert sc.rel_err(sc.grads_of(model, loss), ref) <= EXACT


def test_without_the_audio_merge_the_thinker_trains_on_placeholder_embeddings(models, samples, references):
    """The stock forward takes no precomputed audio: without the adapter's merge the <|AUDIO|> tokens keep their
    own embeddings -- no error, a different loss, and no gradient for the audio tower."""
    model = models["qwen2_5_omni"]
    ref_loss, _ = references["qwen2_5_omni"]
    from evenflow.vlm import QwenVLAdapter

    class VisionMergeOnly(QwenOmniAdapter):
        _call = QwenVLAdapter._call

    _, llm, batch = sc.local_llm(model, samples["qwen2_5_omni"], "padded")
    loss = sc.targets_loss(VisionMergeOnly(model).forward(model, llm, batch), batch.targets) / \
        sc.supervised(samples["qwen2_5_omni"])
    assert abs(float(loss.detach()) - ref_loss) > 1e-6 * ref_loss
    grads = sc.grads_of(model, loss)
    assert all(float(g.abs().max()) == 0 for n, g in grads.items() if ".audio_tower." in n)


def test_deepstack_rows_travel_beside_each_merged_token(models, samples, references):
    """Qwen3-VL's tower gives, per merged token, its row and one per deepstack layer, all from the item's own
    rows; a merge that drops the deepstack columns trains without them -- no error, another loss."""
    model = models["qwen3_vl"]
    adapter = Qwen3VLAdapter(model)
    visual = model.model.visual
    assert adapter.hidden_size == 32 * (1 + len(visual.deepstack_visual_indexes)) == 96
    grid = torch.tensor([[1, 8, 12], [2, 4, 8]])
    rows = torch.randn(int(grid.prod(-1).sum()), sc.PATCH, dtype=torch.float64)
    both = adapter.encode("vision", rows, [96, 64], torch.tensor([[0, 1, 8, 12], [1, 2, 4, 8]]))
    alone = adapter.encode("vision", rows[96:], [64], torch.tensor([[1, 2, 4, 8]]))
    frames = adapter.encode("vision", rows[96:], [32, 32], torch.tensor([[1, 1, 4, 8], [1, 1, 4, 8]]))
    assert both.shape == (40, 96) and torch.equal(both[24:], alone) and torch.equal(frames, alone)
    ref_loss, _ = references["qwen3_vl"]
    _, llm, batch = sc.local_llm(model, samples["qwen3_vl"], "padded")
    llm.media["vision"] = torch.cat([llm.media["vision"][:, :32], torch.zeros_like(llm.media["vision"][:, 32:])], 1)
    loss = sc.targets_loss(adapter.forward(model, llm, batch), batch.targets) / sc.supervised(samples["qwen3_vl"])
    assert abs(float(loss.detach()) - ref_loss) > 1e-6 * ref_loss


def test_qwen3_videos_are_items_of_one_frame(models, samples):
    rank0 = sc.per_rank_samples(family="qwen3_vl")[0]
    video = Qwen3VLAdapter(models["qwen3_vl"]).find_items(PadCollate()(rank0))[2]
    assert video.media_meta["vision"] == [(1, 1, 4, 8)] * 3
    assert torch.equal(torch.cat(video.media["vision"]), rank0[2]["pixel_values_videos"])


# -- the adapters on hostile batches -----------------------------------------------------------------------------
def test_a_clip_that_does_not_fill_its_placeholders_is_refused_naming_the_example():
    rank0 = sc.per_rank_samples(family="qwen2_5_omni")[0]
    bad = copy.deepcopy(rank0)
    bad[1]["feature_attention_mask"][0, 60:] = 0  # 60 of the 70 frames: 15 rows for 17 placeholders
    with pytest.raises(ExampleError, match=r"example 1 .*dataset index 8.*60 mel frames -> 15 .*placeholder run has 17"):
        QwenOmniAdapter(sc.tiny_model("qwen2_5_omni")).find_items(PadCollate()(bad), sample_ids=[7, 8, 9])


def test_a_thinker_video_without_its_seconds_is_refused():
    rank0 = sc.per_rank_samples(family="qwen2_5_omni")[0]
    bad = copy.deepcopy(rank0)
    del bad[2]["second_per_grid_ts"]
    with pytest.raises(ExampleError, match=r"example 2 .*video_second_per_grid"):
        QwenOmniAdapter(sc.tiny_model("qwen2_5_omni")).find_items(FlatCollate()(bad), samples=3)


def test_audio_slices_cut_at_the_window_and_keep_the_positions(models):
    rank0 = sc.per_rank_samples(family="qwen2_5_omni")[0]
    whole = QwenOmniAdapter(models["qwen2_5_omni"]).find_items(PadCollate()(rank0))
    cut = QwenOmniAdapter(models["qwen2_5_omni"], VLMConfig(audio_slice=2)).find_items(PadCollate()(rank0))
    assert [t.shape[0] for t in whole[1].media["audio"]] == [70]
    assert [t.shape[0] for t in cut[1].media["audio"]] == [32, 32, 6]          # 2 windows of 16 frames each
    assert torch.equal(torch.cat(cut[1].media["audio"]), whole[1].media["audio"][0])
    assert torch.equal(cut[1].token_fields["position_ids"], whole[1].token_fields["position_ids"])


# -- the warm-up fit --------------------------------------------------------------------------------------------
def test_a_warm_up_that_cannot_resolve_a_phase_refuses_to_fit():
    """Times that do not grow with the size (a tiny tower, all per-call overhead) would fit a zero cost, and a
    zero-cost phase is not balanced at all: refused, naming the phase (every rank raises, see warmup.py)."""
    from evenflow.vlm.warmup import _fit

    grows = [(16, 1.0e-3), (64, 1.6e-3), (144, 2.9e-3)]
    coef = _fit({"vision": grows, "llm": grows})
    assert coef[0, 0] == 0 and coef[0, 1] > 0 and coef[1, 0] > 0  # an encoder's per-call time is no item's cost
    with pytest.raises(ValueError, match="could not tell the audio phase's sizes apart"):
        _fit({"vision": grows, "audio": [(4, 2e-3), (8, 2e-3), (16, 1.9e-3)], "llm": grows})


def test_a_warm_up_times_several_items_a_call_and_charges_each_its_share(models):
    """``items_per_call=k``: an encoder runs on k copies of each item in one call (its per-call overhead shared, as
    in a step), the time divided by k and the size still one item's; the LLM phase stays one example a call."""
    from evenflow.vlm import WarmupConfig, time_phases

    model = models["qwen2_5_omni"]
    adapter = adapter_for(model, VLMConfig())
    calls = []

    class Counting:  # the model's own adapter, counting the items each encoder call gets
        def __getattr__(self, name):
            return getattr(adapter, name)

        def encode(self, phase, rows, item_rows, meta):
            calls.append((phase, len(item_rows), int(sum(item_rows)), int(rows.shape[0])))
            return adapter.encode(phase, rows, item_rows, meta)

    sizes = dict(vision_rows=(16, 64, 144), llm_tokens=(8, 16, 32), audio_fractions=(0.25, 0.5, 1.0), repeats=1)
    one = time_phases(model, Counting(), config=WarmupConfig(**sizes))
    assert {(p, n) for p, n, _, _ in calls} == {("vision", 1), ("audio", 1)}
    calls.clear()
    three = time_phases(model, Counting(), config=WarmupConfig(**sizes, items_per_call=3))
    assert {(p, n) for p, n, _, _ in calls} == {("vision", 3), ("audio", 3)}
    assert all(rows == total for _, _, total, rows in calls)  # the rows of all three items went in
    assert {p: [s for s, _ in v] for p, v in three.items()} == {p: [s for s, _ in v] for p, v in one.items()}
    with pytest.raises(ValueError, match="items_per_call must be a positive integer"):
        WarmupConfig(items_per_call=0)
