"""One multimodal sample as a processor returns it: its encoder rows, and its padding taken off (pure).

A sample is what a Hugging Face processor returns for one conversation with the batch dimension removed:
``input_ids``, ``attention_mask``, ``labels``, ``pixel_values`` + ``image_grid_thw``, ``pixel_values_videos`` +
``video_grid_thw``, audio ``input_features`` + ``feature_attention_mask``, optional ``mm_token_type_ids``;
a text-only sample has no media keys. The loader reads two things off it that the user should never have to
compute: the encoder rows a batch budget counts ([`encoder_rows()`][encoder_rows], from the grids) and the real tokens
of a sample a processor padded ([`unpad()`][unpad], from ``attention_mask``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

from ..errors import sample_of

__all__ = ["ENCODER_ROWS", "AUDIO_FRAMES", "PADDED_TOKEN_KEYS", "encoder_rows", "audio_frames", "media_resources",
           "unpad", "unpadded"]

ENCODER_ROWS = "num_patches"
"""The loader's resource name of a sample's vision patch rows (``max_encoder_rows`` budgets it; a
[`PhaseTime`][evenflow.planning.PhaseTime] on this key costs the vision phase)."""
AUDIO_FRAMES = "num_frames"
"""The loader's resource name of a sample's audio mel frames (the audio phase's length key)."""
PADDED_TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "token_type_ids", "position_ids")
"""Per-token keys [`unpad()`][unpad] cuts (along their last dimension) when a sample carries padding."""


def _array(value: object) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def encoder_rows(sample: Mapping) -> int:
    """Vision patch rows of one sample before merging: ``t * h * w`` summed over ``image_grid_thw`` and
    ``video_grid_thw`` (0 for a text-only sample). What ``pixel_values`` / ``pixel_values_videos`` hold."""
    total = 0
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = sample.get(key)
        if grid is None:
            continue
        g = _array(grid).reshape(-1, 3).astype(np.int64)
        total += int(g.prod(axis=1).sum())
    return total


def audio_frames(sample: Mapping) -> int:
    """Mel frames of one sample's audio clips: the ones of ``feature_attention_mask``, else every frame of
    ``input_features`` (``(n_mels, frames)`` or ``(clips, n_mels, frames)``); 0 without audio."""
    mask = sample.get("feature_attention_mask")
    if mask is not None:
        return int((_array(mask) != 0).sum())
    features = sample.get("input_features")
    if features is None:
        return 0
    shape = _array(features).shape
    return int(shape[-1] * (shape[0] if len(shape) == 3 else 1))


def media_resources(sample: Mapping) -> dict[str, int]:
    """``{ENCODER_ROWS: ..., AUDIO_FRAMES: ...}`` of one sample, from its grids and clips."""
    return {ENCODER_ROWS: encoder_rows(sample), AUDIO_FRAMES: audio_frames(sample)}


def _cut(value: object, keep: slice, length: int) -> object:
    if isinstance(value, torch.Tensor):
        return value[..., keep] if value.ndim and value.shape[-1] == length else value
    if isinstance(value, np.ndarray):
        return value[..., keep] if value.ndim and value.shape[-1] == length else value
    if isinstance(value, (list, tuple)) and len(value) == length:
        return type(value)(value[keep])
    return value


def unpad(sample: Mapping) -> Mapping:
    """The sample without the padding its ``attention_mask`` marks (left or right): the same tokens, labels and
    media, as if the processor had not padded. A sample without zeros in its mask comes back as it is.

    >>> unpad({"input_ids": [0, 0, 5, 6], "attention_mask": [0, 0, 1, 1], "labels": [-100, -100, 5, 6]})
    {'input_ids': [5, 6], 'attention_mask': [1, 1], 'labels': [5, 6]}

    Raises ``ValueError`` for a mask that is not one run of ones (zeros between real tokens: two sequences in
    one sample) or is all zeros, and for one of another length than ``input_ids``.
    """
    mask = sample.get("attention_mask") if isinstance(sample, Mapping) else None
    if mask is None or "input_ids" not in sample:
        return sample
    m = _array(mask)
    if m.ndim != 1:
        return sample  # not one sequence: measuring the sample names what is wrong with its shape
    length = int(_array(sample["input_ids"]).reshape(-1).size) if _array(sample["input_ids"]).ndim == 1 else -1
    if m.size != length:
        raise ValueError(f"'attention_mask' has {m.size} entries but 'input_ids' has {length}; they must align "
                         "token for token (remove the batch dimension the processor adds: sample[k][0])")
    real = np.flatnonzero(m != 0)
    if real.size == m.size:
        return sample
    if not real.size:
        raise ValueError("'attention_mask' is all zeros: the sample has no real token; filter it out in the dataset")
    first, last = int(real[0]), int(real[-1])
    if last - first + 1 != real.size:
        raise ValueError(f"'attention_mask' has zeros between real tokens (its ones run from {first} to {last} with "
                         f"{last - first + 1 - real.size} zeros inside): one sample is one sequence, padded only at "
                         "its start or end; split it into several samples")
    keep = slice(first, last + 1)
    return {k: _cut(v, keep, length) if k in PADDED_TOKEN_KEYS else v for k, v in sample.items()}


def unpadded(stream: Iterator) -> Iterator:
    """``(key, sample)`` pairs with [`unpad()`][unpad] applied; an error names the sample's dataset index or key."""
    for key, sample in stream:
        try:
            yield key, unpad(sample)
        except ValueError as exc:
            index = sample_of(key)
            raise ValueError(f"sample {index if index is not None else key}: {exc} (the loader trains a padded "
                             "sample on the tokens its attention_mask marks real)") from None
