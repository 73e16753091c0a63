"""Multimodal pipeline: real images -> Qwen2-VL patches -> the real number of ``<|image_pad|>`` tokens.

Images are the 26 photographs and test images shipped inside the scikit-image wheel (``skimage/data``,
102x102 up to 1411x1411). transformers' ``Qwen2VLImageProcessor`` (no weights; PIL backend) resizes each to
multiples of 28 pixels within ``[min_pixels, max_pixels]`` and cuts 14x14 patches; ``merge_size**2 = 4``
patches become one LLM token. Example: ``astronaut.png`` (512x512) -> grid ``(1, 36, 36)`` = 1,296 patches
-> 324 ``<|image_pad|>`` tokens. A seeded per-sample rescale (augmentation) varies sizes across the epoch.

Each sample pairs one image with the first exchange of a chitchat conversation, Qwen2-VL style::

    <|im_start|>user\\n<|vision_start|><|image_pad|> x n<|vision_end|>hi<|im_end|>\\n<|im_start|>assistant\\n...

and reports ``num_patches`` (vision-encoder cost) next to ``input_ids`` (LLM cost), so both budgets apply.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .chat import IGNORE_INDEX, Message, QwenChatTokenizer
from .deps import require

__all__ = ["ImageChatDataset", "ProcessedImage", "augmented_image", "process_image", "expand_placeholder",
           "skimage_image_paths", "IMAGE_PLACEHOLDER"]

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What the Qwen2-VL template writes for one image; the single ``<|image_pad|>`` is expanded after tokenizing."""

DEFAULT_MAX_PIXELS = 512 * 28 * 28
"""Largest resized image: 512 LLM tokens per image (Qwen2-VL's own default is 1,280 tokens)."""
DEFAULT_MIN_PIXELS = 4 * 28 * 28
"""Smallest resized image: 4 LLM tokens."""


def skimage_image_paths() -> list[Path]:
    """The real images shipped with scikit-image (sorted by file name), without importing ``skimage``."""
    require("skimage", "the multimodal demo images")
    spec = importlib.util.find_spec("skimage")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not paths:
        raise FileNotFoundError(f"no images found in {folder}; reinstall scikit-image (`pip install scikit-image`)")
    return paths


@lru_cache(maxsize=4)
def image_processor(min_pixels: int, max_pixels: int, pid: int) -> Any:
    """The Qwen2-VL image processor (it also makes video rows), one per process (``pid``: a forked worker
    builds its own)."""
    del pid
    require("transformers", "the Qwen2-VL image processor")
    import transformers

    # transformers >= 5 names the PIL backend explicitly (and warns when the default class falls back to it
    # without torchvision); earlier versions only have the PIL-based class.
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    return cls(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})



@dataclass(frozen=True)
class ProcessedImage:
    """One image after the Qwen2-VL processor: patch rows and the token count they expand to."""

    pixel_values: np.ndarray
    """float32 ``[num_patches, 1176]``; each run of ``merge_size**2`` consecutive rows is one LLM token."""
    grid: np.ndarray
    """``image_grid_thw`` as int64 ``[1, 3]``."""
    num_patches: int
    num_tokens: int


def augmented_image(path: str | os.PathLike[str], *, seed: int, index: int,
                    scale_range: tuple[float, float]) -> Any:
    """``path`` as RGB, rescaled by a factor seeded by ``(seed, index)`` (the augmentation)."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
    # Per-sample seeded rescale: the same index gets the same image size in every process and epoch.
    scale = np.random.default_rng([seed, index]).uniform(*scale_range)
    size = (max(28, round(img.width * scale)), max(28, round(img.height * scale)))
    return img.resize(size, Image.Resampling.BICUBIC)


def process_image(path: str | os.PathLike[str], *, seed: int, index: int, scale_range: tuple[float, float],
                  min_pixels: int = DEFAULT_MIN_PIXELS, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProcessedImage:
    """[`augmented_image()`][augmented_image] through the Qwen2-VL processor."""
    processor = image_processor(min_pixels, max_pixels, os.getpid())
    out = processor(images=augmented_image(path, seed=seed, index=index, scale_range=scale_range),
                    return_tensors="np")
    grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(1, 3)
    num_patches = int(grid.prod())
    return ProcessedImage(pixel_values=np.ascontiguousarray(out["pixel_values"], dtype=np.float32), grid=grid,
                          num_patches=num_patches, num_tokens=num_patches // processor.merge_size ** 2)


def expand_placeholder(ids: np.ndarray, labels: np.ndarray, marker: int, count: int,
                       new_id: int | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Replace the first ``marker`` token by ``count`` copies of ``new_id`` (default: ``marker``), unsupervised.

    Returns ``(ids, labels, position)``. ``[5, M, 6]`` with ``count=3`` -> ``[5, M, M, M, 6]``, labels -100 there.
    """
    hits = np.flatnonzero(ids == marker)
    if not hits.size:
        raise ValueError(f"token {marker} not found in the rendered sample: the template dropped the placeholder")
    at = int(hits[0])
    fill = marker if new_id is None else new_id
    ids = np.concatenate([ids[:at], np.full(count, fill, np.int64), ids[at + 1:]])
    labels = np.concatenate([labels[:at], np.full(count, IGNORE_INDEX, np.int64), labels[at + 1:]])
    return ids, labels, at


class ImageChatDataset(torch.utils.data.Dataset):
    """``num_samples`` image + chat samples; ``__getitem__`` loads, augments and processes the image.

    Item keys: ``input_ids``, ``labels`` (LongTensor[n]), ``pixel_values`` (float32 [num_patches, 1176]),
    ``image_grid_thw`` (LongTensor[1, 3]), ``num_patches`` and ``num_image_tokens`` (ints).
    """

    def __init__(self, conversations: Sequence[Sequence[Message]], *, num_samples: int | None = None,
                 tokenizer: QwenChatTokenizer | None = None,
                 image_paths: Sequence[str | os.PathLike[str]] | None = None,
                 scale_range: tuple[float, float] = (0.35, 1.0), min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS, cutoff: int | None = None, seed: int = 0) -> None:
        if not conversations:
            raise ValueError("conversations is empty: each image needs a chat to pair with")
        lo, hi = scale_range
        if not 0 < lo <= hi:
            raise ValueError(f"scale_range must satisfy 0 < low <= high, got {scale_range}")
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
        self.conversations = [list(c) for c in conversations]
        self.image_paths = [str(p) for p in (image_paths if image_paths is not None else skimage_image_paths())]
        self.num_samples = num_samples if num_samples is not None else len(self.image_paths) * 10
        self.tokenizer = tokenizer if tokenizer is not None else QwenChatTokenizer()
        self.scale_range = (float(lo), float(hi))
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.cutoff = cutoff
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def _image(self, index: int) -> Any:
        return augmented_image(self.image_paths[index % len(self.image_paths)], seed=self.seed, index=index,
                               scale_range=self.scale_range)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        image = process_image(self.image_paths[index % len(self.image_paths)], seed=self.seed, index=index,
                              scale_range=self.scale_range, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        conv = self.conversations[index % len(self.conversations)][:2]
        messages = [{"role": conv[0]["role"], "content": IMAGE_PLACEHOLDER + conv[0]["content"]}, *conv[1:]]
        ids, labels = self.tokenizer.encode_chat(messages)
        pad = self.tokenizer.token_id("<|image_pad|>")
        ids, labels, at = expand_placeholder(ids, labels, pad, image.num_tokens)
        if self.cutoff is not None and len(ids) > self.cutoff:
            if at + image.num_tokens + 1 > self.cutoff:
                raise ValueError(f"sample {index}: its image alone needs {image.num_tokens} tokens, beyond "
                                 f"cutoff={self.cutoff}; cutting inside an image would break it -- lower "
                                 f"max_pixels (now {self.max_pixels}) or raise cutoff")
            ids, labels = ids[:self.cutoff], labels[:self.cutoff]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "pixel_values": torch.from_numpy(image.pixel_values), "image_grid_thw": torch.from_numpy(image.grid),
                "num_patches": image.num_patches, "num_image_tokens": image.num_tokens}
