"""Tiny stock Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni thinker from their configs (random init, never a download), and a
vocabulary for them.

The models are the unmodified Hugging Face classes, only small (hidden 32, two text layers, a two-block vision
tower; Qwen2.5-VL with window attention in block 0). Qwen's 151,936-id output layer would dominate such a model
on a CPU (its logits are ``151,936 x tokens`` floats), so [`dense_vocab()`][dense_vocab] keeps the ids a set of chats
uses ([`evenflow.data.vocab.VocabRemap`][evenflow.data.vocab.VocabRemap]), the four vision tokens always: wrap the data
set in [`evenflow.data.vocab.RemappedDataset`][evenflow.data.vocab.RemappedDataset] and build the model with the same
remap. Lengths stay real.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..data.audio import N_MELS
from ..data.chat import Message, QwenChatTokenizer
from ..data.vocab import VocabRemap

__all__ = ["tiny_vlm", "dense_vocab", "VISION_TOKENS", "QWEN_VOCAB", "FAMILY_NAMES"]

QWEN_VOCAB = 151_936
"""Qwen2's vocabulary size (the Qwen3 tokenizer's ids fit in it)."""
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
"""Config field -> the token it names."""
FAMILY_NAMES = ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni")


def _audio_ids() -> dict[str, int]:
    """The Qwen2.5-Omni audio tokens (config field -> id) that ``MultimodalChatDataset(layout="hf")`` writes."""
    from ..data.multimodal import AUDIO_BOS_ID, AUDIO_EOS_ID, OMNI_AUDIO_ID

    return {"audio_token_index": OMNI_AUDIO_ID, "audio_start_token_id": AUDIO_BOS_ID,
            "audio_end_token_id": AUDIO_EOS_ID}


def dense_vocab(conversations: Sequence[Sequence[Message]], *, size: int = 4096) -> VocabRemap:
    """The ``size - 1`` most frequent ids of the chats' first exchanges through the Qwen3 template, plus the four
    vision tokens; every other id becomes ``unk``. Deterministic: every rank builds the same one."""
    tokenizer = QwenChatTokenizer()
    counts = np.zeros(QWEN_VOCAB, dtype=np.int64)
    for conversation in conversations:
        ids, _ = tokenizer.encode_chat(list(conversation)[:2])
        counts += np.bincount(ids, minlength=QWEN_VOCAB)
    return VocabRemap.from_counts(counts, max_size=size,
                                  extra_ids=[tokenizer.token_id(t) for t in VISION_TOKENS.values()]
                                  + list(_audio_ids().values()))


def tiny_vlm(family: str = "qwen2_vl", *, vocab: VocabRemap | None = None, dtype: torch.dtype = torch.float32,
             seed: int = 0) -> torch.nn.Module:
    """A random-init ``Qwen2VLForConditionalGeneration`` (``family="qwen2_vl"``),
    ``Qwen2_5_VLForConditionalGeneration`` (``"qwen2_5_vl"``) or ``Qwen2_5OmniThinkerForConditionalGeneration``
    (``"qwen2_5_omni"``), in training mode; seeded, so every rank builds the same weights. ``vocab``: the remap
    its data went through (``None``: Qwen's full vocabulary and ids)."""
    import transformers

    tokenizer = QwenChatTokenizer()
    ids = {field: tokenizer.token_id(token) for field, token in VISION_TOKENS.items()}
    if family == "qwen2_5_omni":
        ids.update(_audio_ids())
    if vocab is not None:
        ids = {field: int(vocab.table[i]) for field, i in ids.items()}
    text = dict(vocab_size=QWEN_VOCAB if vocab is None else vocab.size, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                eos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                    "rope_theta": 1e4})
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig(vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2),
                                            text_config=text, **ids)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    elif family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               window_size=56, fullatt_block_indexes=[1]), text_config=text, **ids)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    elif family == "qwen2_5_omni":
        # The thinker: Qwen2.5-VL's tower and an audio tower on the data's 80 Whisper mel bins, with the real
        # model's attention window (n_window 100: windows of 200 frames, 2 s), wide enough (128) that a window's
        # time grows with its frames on a CPU (a warm-up can fit it) rather than being all per-call overhead.
        ids["image_token_index"], ids["video_token_index"] = ids.pop("image_token_id"), ids.pop("video_token_id")
        config = transformers.Qwen2_5OmniThinkerConfig(
            audio_config=dict(num_mel_bins=N_MELS, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=512,
                              d_model=128, n_window=100, output_dim=32),
            vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               window_size=56, fullatt_block_indexes=[1]), text_config=text, **ids)
        model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(config)
    else:
        raise ValueError(f"family must be one of {FAMILY_NAMES}, got {family!r}")
    return model.to(dtype).train()
