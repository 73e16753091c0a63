"""Short videos made from real photos: a pan across a scikit-image photo, through the Qwen2-VL image processor.

Qwen2-VL cuts a video into temporal patches of ``temporal_patch_size = 2`` frames: one patch row holds
``[3 channels, 2 frames, 14, 14]`` pixels. The image processor makes one such row from a still image by
repeating it in both frame slots; [`pan_video()`][pan_video] processes ``frames`` crops of one photo (a window moving
left to right, all resized to the same size), then pairs consecutive frames into rows -- frame ``2k`` in slot 0,
frame ``2k + 1`` in slot 1 -- which is the layout the processor gives a video. Grid ``(frames // 2, h, w)``,
``frames // 2 * h * w // 4`` ``<|video_pad|>`` tokens.

[`VideoChatDataset`][VideoChatDataset] turns a seeded fraction of the image samples of a
[`MultimodalChatDataset`][evenflow.data.multimodal.MultimodalChatDataset] (``layout="hf"``) into video samples of the
same photo: ``<|vision_start|> <|video_pad|> x n <|vision_end|>``, ``pixel_values_videos``, ``video_grid_thw``,
``mm_token_type_ids`` 2 on the video tokens, ``num_patches`` = the video's patch rows (so one
``extra_budgets={"num_patches": P}`` budgets images and videos alike).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .chat import IGNORE_INDEX
from .images import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, augmented_image, image_processor

__all__ = ["ProcessedVideo", "pan_video", "video_rows", "VideoChatDataset", "TEMPORAL_PATCH"]

TEMPORAL_PATCH = 2
"""Frames per temporal patch (Qwen2-VL / Qwen2.5-VL ``temporal_patch_size``)."""
_VIDEO_SALT = 0x5649
"""Separates the image -> video draw from the kind and rescale draws seeded by the same ``(seed, index)``."""


@dataclass(frozen=True)
class ProcessedVideo:
    """One video after the Qwen2-VL processor: patch rows and the token count they expand to."""

    pixel_values_videos: np.ndarray
    """float32 ``[t * h * w, 1176]``, temporal patch by temporal patch."""
    grid: np.ndarray
    """``video_grid_thw`` as int64 ``[1, 3]``."""
    num_patches: int
    num_tokens: int


def pan_video(path: str | os.PathLike[str], *, frames: int, seed: int, index: int,
              scale_range: tuple[float, float] = (0.35, 1.0), pan: float = 0.25,
              min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProcessedVideo:
    """``frames`` crops of the (seeded, rescaled) photo, each ``1 - pan`` of its width, sliding across it."""
    if frames < TEMPORAL_PATCH or frames % TEMPORAL_PATCH:
        raise ValueError(f"frames must be a positive multiple of {TEMPORAL_PATCH} (the temporal patch), got {frames}")
    if not 0 <= pan < 1:
        raise ValueError(f"pan must be a fraction of the width in [0, 1), got {pan}")
    image = augmented_image(path, seed=seed, index=index, scale_range=scale_range)
    width = max(28, round(image.width * (1 - pan)))
    processor = image_processor(min_pixels, max_pixels, os.getpid())
    lefts = [round((image.width - width) * f / max(frames - 1, 1)) for f in range(frames)]
    rows, grid = video_rows(processor, [image.crop((left, 0, left + width, image.height)) for left in lefts])
    num_patches = int(grid.prod())
    return ProcessedVideo(pixel_values_videos=rows, grid=grid, num_patches=num_patches,
                          num_tokens=num_patches // processor.merge_size ** 2)


def video_rows(processor: Any, frames: list) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values_videos, video_grid_thw [1, 3])`` of ``frames`` (an even count, all resized alike) through a
    Qwen2-VL image processor: each processed still holds its frame in both temporal slots
    (``[rows, 3, 2, 14 * 14]``); frame ``2k`` keeps slot 0 and frame ``2k + 1`` gives slot 1."""
    stills, grid = [], None
    for frame in frames:
        out = processor(images=frame, return_tensors="np")
        g = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(3)
        if grid is not None and not np.array_equal(g, grid):
            raise AssertionError(f"frames of one video resized differently: {grid} then {g}")
        grid = g
        stills.append(np.asarray(out["pixel_values"], dtype=np.float32))
    per_frame = [r.reshape(r.shape[0], 3, TEMPORAL_PATCH, -1) for r in stills]
    patches = [np.stack([per_frame[k][:, :, 0], per_frame[k + 1][:, :, 1]], axis=2).reshape(stills[0].shape)
               for k in range(0, len(frames), TEMPORAL_PATCH)]
    grid = np.array([[len(frames) // TEMPORAL_PATCH, grid[1], grid[2]]], dtype=np.int64)
    return np.ascontiguousarray(np.concatenate(patches)), grid


class VideoChatDataset(torch.utils.data.Dataset):
    """A ``MultimodalChatDataset(layout="hf")`` whose image samples become, with probability ``video_fraction``
    (seeded by ``(seed, index)``), a video panning across the same photo: ``frames`` frames, or one of the
    given counts (seeded too) when ``frames`` is a tuple. Spoken samples (a mix with audio) pass unchanged.
    ``fps``: the video's frame rate, given to the model as ``second_per_grid_ts`` (``temporal_patch_size /
    fps`` seconds per temporal patch; the Omni thinker's positions need it); ``None``: no such key."""

    def __init__(self, base: Any, *, video_fraction: float = 0.3, frames: int | tuple[int, ...] = 4, seed: int = 0,
                 video_token: str = "<|video_pad|>", fps: float | None = None) -> None:
        if getattr(base, "layout", None) != "hf":
            raise ValueError("VideoChatDataset wraps a MultimodalChatDataset(layout='hf') (it rewrites HF keys)")
        if fps is not None and not fps > 0:
            raise ValueError(f"fps must be a positive frame rate or None, got {fps!r}")
        if not 0 <= video_fraction <= 1:
            raise ValueError(f"video_fraction must be in [0, 1], got {video_fraction}")
        self.frame_choices = (frames,) if isinstance(frames, int) else tuple(frames)
        if not self.frame_choices or any(f < TEMPORAL_PATCH or f % TEMPORAL_PATCH for f in self.frame_choices):
            raise ValueError(f"frames must be positive multiples of {TEMPORAL_PATCH} (the temporal patch), got "
                             f"{frames}")
        self.base = base
        self.fps = fps
        self.video_fraction = float(video_fraction)
        self.seed = seed
        self.image_id = base.tokenizer.token_id("<|image_pad|>")
        self.video_id = base.tokenizer.token_id(video_token)

    def __len__(self) -> int:
        return len(self.base)

    def is_video(self, index: int) -> bool:
        """Whether sample ``index`` is a video (cheap: no media is processed)."""
        if self.base.kind(index) != "image":
            return False
        return bool(np.random.default_rng([self.seed, index, _VIDEO_SALT]).random() < self.video_fraction)

    def frames(self, index: int) -> int:
        """The frame count of sample ``index`` if it is a video."""
        rng = np.random.default_rng([self.seed, index, _VIDEO_SALT, 1])
        return self.frame_choices[int(rng.integers(len(self.frame_choices)))]

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.base[index]
        if not self.is_video(index):
            return sample
        b = self.base
        video = pan_video(b.image_paths[index % len(b.image_paths)], frames=self.frames(index), seed=b.seed,
                          index=index, scale_range=b.scale_range, min_pixels=b.min_pixels, max_pixels=b.max_pixels)
        ids, labels = sample["input_ids"], sample["labels"]
        at = torch.nonzero(ids == self.image_id).flatten()
        start, end = int(at[0]), int(at[-1]) + 1
        n = video.num_tokens
        ids = torch.cat([ids[:start], torch.full((n,), self.video_id, dtype=ids.dtype), ids[end:]])
        labels = torch.cat([labels[:start], torch.full((n,), IGNORE_INDEX, dtype=labels.dtype), labels[end:]])
        if b.cutoff is not None and len(ids) > b.cutoff:
            if start + n + 1 > b.cutoff:
                raise ValueError(f"sample {index} (video): its {n} video tokens do not fit cutoff={b.cutoff}; lower "
                                 f"max_pixels ({b.max_pixels}) or frames ({self.frames(index)}), or raise cutoff")
            ids, labels = ids[:b.cutoff], labels[:b.cutoff]
        out = {k: v for k, v in sample.items() if k not in ("pixel_values", "image_grid_thw")}
        out.update(input_ids=ids, labels=labels, mm_token_type_ids=2 * (ids == self.video_id).long(),
                   pixel_values_videos=torch.from_numpy(video.pixel_values_videos),
                   video_grid_thw=torch.from_numpy(video.grid), num_patches=video.num_patches,
                   num_image_tokens=0)
        if self.fps is not None:  # what Qwen2.5-VL's and the Omni thinker's M-RoPE time positions step by
            out["second_per_grid_ts"] = torch.tensor([TEMPORAL_PATCH / self.fps])
        return out
