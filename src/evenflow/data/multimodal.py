"""Three modalities on real media: chitchat text, scikit-image photos, eSpeak NG speech, mixed at set ratios.

Each index draws its kind from [`MediaMix`][MediaMix] with a generator seeded by ``(seed, index)`` -- the same
sample in every process and epoch -- and pairs it with the first exchange of a chitchat conversation:

- ``text``  -- the exchange as written;
- ``image`` -- a photo before the user's words (Qwen2-VL layout, see `evenflow.data.images`);
- ``audio`` -- the user's words *spoken* (eSpeak NG) instead of written: log-mel frames and
  ``frames // AUDIO_FRAME_STRIDE`` audio placeholder tokens (NOTE [ Audio frame stride ] in ``audio.py``);
- ``both``  -- a photo and the spoken words.

Everything is measured after preprocessing: ``len(input_ids)`` is the realized LLM length (placeholders
included), ``num_patches`` the vision encoder's rows, ``num_frames`` the audio encoder's rows. Both keys are
present (0 when absent), so ``DynamicBatchLoader(..., extra_budgets={"num_patches": P, "num_frames": F})``
budgets them directly. Layout of an ``audio`` sample (tokens abridged, ``A`` = ``AUDIO_PAD_ID``)::

    <|im_start|> user \\n A A A ... A <|im_end|> \\n <|im_start|> assistant \\n fine thanks <|im_end|> \\n

NOTE [ The HF layout of multimodal samples ]
    ``layout="hf"`` gives each sample only the keys of the media it has, in the form HF multimodal models take
    them, so [`evenflow.PadCollate`][evenflow.PadCollate] batches any mix of kinds into what the model's forward
    consumes (NOTE [ Extra keys in the default collates ] in evenflow.runtime.collate_extras):

    - image: ``pixel_values`` ``[num_patches, 1176]`` and ``image_grid_thw`` ``[1, 3]`` (Qwen2-VL; the batch
      concatenates them over images), placeholders ``<|vision_start|> <|image_pad|> x n <|vision_end|>``;
    - audio: ``input_features`` ``[80, frames]`` (the Whisper feature-extractor layout; the batch pads clips and
      adds ``feature_attention_mask``), placeholders as Qwen2.5-Omni writes them: ``AUDIO_BOS_ID``,
      ``OMNI_AUDIO_ID`` x ``frames // 4`` (its audio encoder's output length for a multiple of 4 frames),
      ``AUDIO_EOS_ID`` -- ids of the Qwen2 vocabulary Qwen3 shares;
    - text-only: neither. ``mm_token_type_ids`` (Qwen2-VL's per-token modality: 1 on image tokens, else 0),
      ``num_patches`` / ``num_frames`` (0 when absent) and ``kind`` are on every sample.

    A tiny ``Qwen2_5OmniThinkerForConditionalGeneration`` built from its config trains on such batches
    (tests/test_multimodal_hf.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .audio import AUDIO_FRAME_STRIDE, AUDIO_PAD_ID, N_MELS, speech_features
from .chat import Message, QwenChatTokenizer
from .images import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, IMAGE_PLACEHOLDER, expand_placeholder, process_image,
                     skimage_image_paths)

__all__ = ["MediaMix", "MultimodalChatDataset", "MediaCollate", "KINDS", "PATCH_DIM", "media_profile",
           "OMNI_AUDIO_ID", "AUDIO_BOS_ID", "AUDIO_EOS_ID"]

KINDS = ("text", "image", "audio", "both")
"""Sample kinds; ``sample["kind"]`` is an index into this tuple."""
PATCH_DIM = 3 * 2 * 14 * 14
"""Qwen2-VL patch row width: 3 channels x 2 frames (temporal patch) x 14 x 14 pixels."""
_AUDIO_MARKER = "<|video_pad|>"
"""A Qwen3 token that chitchat text never contains, written where the audio goes and then expanded to
``AUDIO_PAD_ID`` x tokens (the vocabulary has no audio token of its own)."""
OMNI_AUDIO_ID = 151_646
"""``<|AUDIO|>`` of Qwen2.5-Omni (``audio_token_index``): the audio placeholder of ``layout="hf"`` samples."""
AUDIO_BOS_ID = 151_647
"""``<|audio_bos|>`` of Qwen2.5-Omni (``audio_start_token_id``)."""
AUDIO_EOS_ID = 151_648
"""``<|audio_eos|>`` of Qwen2.5-Omni (``audio_end_token_id``)."""
_KIND_SALT = 0x4D49
"""Separates the kind draw from the image-rescale draw, which is seeded by the same ``(seed, index)``."""


@dataclass(frozen=True, kw_only=True)
class MediaMix:
    """Relative weights of the four sample kinds (normalized; zero excludes a kind)."""

    text: float = 0.4
    image: float = 0.25
    audio: float = 0.25
    both: float = 0.1

    def __post_init__(self) -> None:
        weights = self.weights()
        if (weights < 0).any() or not np.isfinite(weights).all() or weights.sum() <= 0:
            raise ValueError(f"MediaMix weights must be finite, >= 0 and not all 0, got {dict(zip(KINDS, weights))}")

    def weights(self) -> np.ndarray:
        return np.array([self.text, self.image, self.audio, self.both], dtype=np.float64)

    def probabilities(self) -> np.ndarray:
        w = self.weights()
        return w / w.sum()


class MultimodalChatDataset(torch.utils.data.Dataset):
    """``num_samples`` text / image / audio / image+audio chat samples; the whole pipeline runs in ``__getitem__``.

    Item keys: ``input_ids``, ``labels`` (LongTensor[n]); ``pixel_values`` (float32 ``[num_patches, 1176]``,
    zero rows without an image); ``audio_features`` (float32 ``[num_frames, 80]``); ints ``num_patches``,
    ``num_frames``, ``num_image_tokens``, ``num_audio_tokens`` and ``kind`` (index into [`KINDS`][KINDS]).
    ``layout="hf"``: only the media keys a sample has, in the form HF models take (NOTE [ The HF layout of
    multimodal samples ]).
    """

    def __init__(self, conversations: Sequence[Sequence[Message]], *, num_samples: int | None = None,
                 mix: MediaMix = MediaMix(), tokenizer: QwenChatTokenizer | None = None,
                 image_paths: Sequence[str | os.PathLike[str]] | None = None,
                 scale_range: tuple[float, float] = (0.35, 1.0), min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS, max_frames: int = 3000, cutoff: int | None = None,
                 voice: str = "en", seed: int = 0, layout: str = "rows") -> None:
        if layout not in ("rows", "hf"):
            raise ValueError(f"layout must be 'rows' or 'hf', got {layout!r}")
        if not conversations:
            raise ValueError("conversations is empty: every sample needs a chat exchange")
        if not 0 < scale_range[0] <= scale_range[1]:
            raise ValueError(f"scale_range must satisfy 0 < low <= high, got {scale_range}")
        if max_frames < AUDIO_FRAME_STRIDE:
            raise ValueError(f"max_frames={max_frames} is below one audio token ({AUDIO_FRAME_STRIDE} frames)")
        self.conversations = [list(c)[:2] for c in conversations]
        for i, conv in enumerate(self.conversations):
            if not conv or not str(conv[0].get("content", "")).strip():
                raise ValueError(f"conversation {i} has no first turn with text to speak; filter it out")
        self.num_samples = len(self.conversations) if num_samples is None else int(num_samples)
        self.mix = mix
        self.tokenizer = tokenizer if tokenizer is not None else QwenChatTokenizer()
        self.image_paths = [str(p) for p in (image_paths if image_paths is not None else skimage_image_paths())]
        self.scale_range = (float(scale_range[0]), float(scale_range[1]))
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.max_frames = max_frames
        self.cutoff = cutoff
        self.voice = voice
        self.seed = seed
        self.layout = layout

    def __len__(self) -> int:
        return self.num_samples

    def kind(self, index: int) -> str:
        """The kind of sample ``index`` (cheap: no media is processed)."""
        rng = np.random.default_rng([self.seed, index, _KIND_SALT])
        return KINDS[int(rng.choice(len(KINDS), p=self.mix.probabilities()))]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        kind = self.kind(index)
        conv = self.conversations[index % len(self.conversations)]
        spoken = str(conv[0]["content"])
        has_image, has_audio = kind in ("image", "both"), kind in ("audio", "both")
        content = (IMAGE_PLACEHOLDER if has_image else "") + (_AUDIO_MARKER if has_audio else spoken)
        ids, labels = self.tokenizer.encode_chat([{"role": conv[0]["role"], "content": content}, *conv[1:]])
        media_end = 0
        pixels, n_img = np.zeros((0, PATCH_DIM), np.float32), 0
        if has_image:
            image = process_image(self.image_paths[index % len(self.image_paths)], seed=self.seed, index=index,
                                  scale_range=self.scale_range, min_pixels=self.min_pixels,
                                  max_pixels=self.max_pixels)
            pixels, n_img = image.pixel_values, image.num_tokens
            ids, labels, at = expand_placeholder(ids, labels, self.tokenizer.token_id("<|image_pad|>"), n_img)
            media_end = max(media_end, at + n_img)
        frames, n_aud = np.zeros((0, N_MELS), np.float32), 0
        grid = np.zeros((0, 3), np.int64) if not has_image else image.grid
        hf = self.layout == "hf"
        if has_audio:
            frames = speech_features(spoken, voice=self.voice, max_frames=self.max_frames)
            n_aud = frames.shape[0] // AUDIO_FRAME_STRIDE
            # hf: <|audio_bos|> <|AUDIO|> x n <|audio_eos|> (Qwen2.5-Omni); rows: AUDIO_PAD_ID x n.
            ids, labels, at = expand_placeholder(ids, labels, self.tokenizer.token_id(_AUDIO_MARKER),
                                                 n_aud + 2 * hf, new_id=OMNI_AUDIO_ID if hf else AUDIO_PAD_ID)
            if hf:
                ids[at], ids[at + n_aud + 1] = AUDIO_BOS_ID, AUDIO_EOS_ID
            media_end = max(media_end, at + n_aud + 2 * hf)
        if self.cutoff is not None and len(ids) > self.cutoff:
            if media_end + 1 > self.cutoff:
                raise ValueError(f"sample {index} ({kind}): its media need {media_end} tokens, beyond cutoff="
                                 f"{self.cutoff}; cutting inside an image or a clip would break it -- lower "
                                 f"max_pixels ({self.max_pixels}) / max_frames ({self.max_frames}) or raise cutoff")
            ids, labels = ids[:self.cutoff], labels[:self.cutoff]
        counts = {"num_patches": int(pixels.shape[0]), "num_frames": int(frames.shape[0]),
                  "num_image_tokens": n_img, "num_audio_tokens": n_aud, "kind": KINDS.index(kind)}
        if hf:  # NOTE [ The HF layout of multimodal samples ]
            kinds = (ids == self.tokenizer.token_id("<|image_pad|>")).astype(np.int64)  # 0 text, 1 image
            sample = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                      "mm_token_type_ids": torch.from_numpy(kinds), **counts}
            if has_image:
                sample.update(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grid))
            if has_audio:
                sample["input_features"] = torch.from_numpy(np.ascontiguousarray(frames.T))
            return sample
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "pixel_values": torch.from_numpy(pixels), "audio_features": torch.from_numpy(frames),
                "num_patches": int(pixels.shape[0]), "num_frames": int(frames.shape[0]),
                "num_image_tokens": n_img, "num_audio_tokens": n_aud, "kind": KINDS.index(kind)}


@dataclass(frozen=True)
class MediaCollate:
    """Keep a batch as its list of samples (``{"samples": [...]}``): the orchestrator routes per example."""

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, list]:
        return {"samples": list(samples)}


def media_profile(dataset: MultimodalChatDataset, indices: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Realized ``length``, ``num_patches``, ``num_frames`` and ``kind`` of samples (runs the pipeline)."""
    indices = range(len(dataset)) if indices is None else indices
    rows = [(len(s["input_ids"]), s["num_patches"], s["num_frames"], s["kind"])
            for s in (dataset[int(i)] for i in indices)]
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    return {"length": arr[:, 0], "num_patches": arr[:, 1], "num_frames": arr[:, 2], "kind": arr[:, 3]}
