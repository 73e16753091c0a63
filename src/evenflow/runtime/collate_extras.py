"""The keys beside ``input_ids`` / ``labels`` / ``attention_mask`` in the default collates (media, metadata).

NOTE [ Extra keys in the default collates ]
    Global planning mixes samples read by different ranks in one batch, and multimodal data mixes text-only
    samples with image and audio ones, so a key can be present on some samples of a batch and absent on
    others. The default collates ([`PadCollate`][evenflow.PadCollate], [`FlatCollate`][evenflow.FlatCollate]) collate
    every key found on *any* sample of the batch (never only ``samples[0]``'s), each by what it means -- never by
    the shapes that happen to meet in one batch -- and never drop one silently:

    - Row keys (``ROW_KEYS``: ``pixel_values``, ``image_grid_thw``, their video twins, ``audio_features``):
      per-item rows, concatenated along dim 0 in sample order -- the layout HF vision-language models consume
      (Qwen2-VL: ``pixel_values`` ``(total_patches, 1176)``, ``image_grid_thw`` ``(num_images, 3)``). A sample
      without the key has no such item: it adds zero rows (the fill for mixed text/image data). Two images of
      64 and 16 patches and a text-only sample -> ``pixel_values`` ``(80, 1176)``, ``image_grid_thw``
      ``[[1, 8, 8], [1, 4, 4]]``, whatever the patch counts (equal counts are not stacked).
    - Grids and patch rows are checked per sample before anything is joined (a batch cannot tell whose rows are
      whose once they are concatenated): a grid key (``GRID_KEYS``) is ``(num_items, 3)``, and a sample's patch rows
      are the sum of ``t * h * w`` over its grid's items -- e25fa43 accepted 12 rows for a 16-patch image, and
      where two samples' totals balanced, one image silently trained on another's patches.
    - Audio clips (``input_features``, the HF feature-extractor layout ``(n_mels, frames)`` for one clip or
      ``(clips, n_mels, frames)``): right-padded to the batch's longest clip -> ``input_features``
      ``(num_clips, n_mels, max_frames)`` and ``feature_attention_mask`` ``(num_clips, max_frames)`` (1 on real
      frames; a sample's own mask is kept, and must have one entry per frame of each clip). A sample without
      audio adds no clip. What Qwen2-Audio / Qwen2.5-Omni consume (a model that needs a fixed frame count: pad
      the clips in the dataset).
    - Any other key: per-sample metadata. It must be on every sample of the batch (no fill can be right for
      an unknown key): a missing one raises [`MissingKeyError`][MissingKeyError] naming the key and the sample, which
      the loader reports with the sample's dataset index on every rank. Tensors of one shape are stacked
      (``(batch, ...)``), anything else is handed over as a list (ints, strings, tensors of varying shape).
      A key holding per-item rows of another name: add it to ``row_keys``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["ROW_KEYS", "GRID_KEYS", "CLIP_KEY", "CLIP_MASK_KEY", "SampleError", "MissingKeyError", "collate_extras"]

ROW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
            "audio_features")
"""Keys holding per-item rows, concatenated along dim 0 (NOTE [ Extra keys in the default collates ])."""
GRID_KEYS = {"image_grid_thw": "pixel_values", "video_grid_thw": "pixel_values_videos"}
"""Grid key -> the key of the patch rows it describes: ``(num_items, 3)`` (t, h, w), one row per image or video."""
CLIP_KEY = "input_features"
CLIP_MASK_KEY = "feature_attention_mask"


class SampleError(ValueError):
    """One sample of a batch cannot be collated as it is; the loader names its dataset index (``position``)."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position
        """Position of the sample in the ``samples`` list given to the collate."""


class MissingKeyError(SampleError):
    """A per-sample key present on some samples of a batch and absent on another (never dropped silently)."""


def collate_extras(samples: Sequence[Mapping], skip: Sequence[str], row_keys: Sequence[str]) -> dict:
    """Every key of any sample except ``skip``, collated by NOTE [ Extra keys in the default collates ]."""
    keys: dict[str, None] = {}
    for s in samples:
        keys.update(dict.fromkeys(k for k in s if k not in skip))
    for i, s in enumerate(samples):
        _check_media(i, s, row_keys)
    out: dict = {}
    for key in keys:
        if key in row_keys:
            rows = _rows(samples, key)
            if rows is not None:  # None on every sample: no such item in the batch
                out[key] = rows
        elif key == CLIP_KEY:
            clips = _clips(samples)
            if clips is not None:
                out[CLIP_KEY], out[CLIP_MASK_KEY] = clips
        elif key == CLIP_MASK_KEY and CLIP_KEY in keys:
            continue  # built with the clips
        else:
            out[key] = _per_sample(samples, key)
    return out


def _tensor(value: object) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _check_media(i: int, sample: Mapping, row_keys: Sequence[str]) -> None:
    """One sample's grids against its patch rows (NOTE [ Extra keys in the default collates ])."""
    for grid_key, rows_key in GRID_KEYS.items():
        if grid_key not in row_keys or sample.get(grid_key) is None:
            continue
        grid = _tensor(sample[grid_key])
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise SampleError(
                f"sample {i} of the batch: {grid_key!r} has shape {tuple(grid.shape)}; it must be (num_images, 3), "
                f"one (t, h, w) row per item (the image processor's layout; one image is [[t, h, w]]), or its rows "
                f"are joined wrongly across the batch. Keep the processor's 2-D {grid_key!r} (e.g. grid[None] for a "
                "single (t, h, w))", i)
        if sample.get(rows_key) is None:
            continue
        rows = _tensor(sample[rows_key])
        patches = int(grid.to(torch.long).prod(dim=1).sum())
        if rows.dim() == 0 or rows.shape[0] != patches:
            have = "no rows" if rows.dim() == 0 else f"{rows.shape[0]} rows"
            raise SampleError(
                f"sample {i} of the batch: {rows_key!r} has {have}, but its {grid_key!r} {grid.tolist()} says "
                f"{patches} patches (t * h * w summed over its items). Rows are concatenated across the batch and "
                "split back by the grids, so a mismatch gives one image another's patches. Return the processor's "
                f"{rows_key!r} and {grid_key!r} of the same images together, unmodified", i)


def _clip_mask(i: int, mask: object, clips: int, frames: int) -> torch.Tensor:
    """A sample's own feature mask as ``(clips, frames)``: one entry per frame of each clip."""
    m = _tensor(mask)
    if tuple(m.shape) not in ((clips, frames),) + (((frames,),) if clips == 1 else ()):
        one = f"({frames},) or " if clips == 1 else ""
        raise SampleError(
            f"sample {i} of the batch: {CLIP_MASK_KEY!r} has shape {tuple(m.shape)}, but its {CLIP_KEY!r} holds "
            f"{clips} clip(s) of {frames} frames: the mask must be {one}({clips}, {frames}), 1 on real frames. "
            f"Return the feature extractor's mask of the same clip(s), or drop {CLIP_MASK_KEY!r} (all frames real)", i)
    return m.reshape(clips, frames).to(torch.long)


def _rows(samples: Sequence[Mapping], key: str) -> torch.Tensor | None:
    parts = [(i, _tensor(s[key])) for i, s in enumerate(samples) if s.get(key) is not None]
    if not parts:
        return None
    for i, t in parts:
        if t.dim() == 0:
            raise SampleError(f"sample {i} of the batch: {key!r} is a scalar, but it is a row key (per-item rows, "
                              "concatenated along dim 0); give it a leading rows dimension, or remove it from "
                              "row_keys", i)
    trailing = {tuple(t.shape[1:]) for _, t in parts}
    if len(trailing) > 1:
        shapes = {i: tuple(t.shape) for i, t in parts}
        raise ValueError(f"{key!r} rows have different widths across the batch (sample -> shape: {shapes}); rows "
                         "are concatenated along dim 0, so every dim after the first must match")
    return torch.cat([t for _, t in parts])


def _clips(samples: Sequence[Mapping]) -> tuple[torch.Tensor, torch.Tensor] | None:
    feats, masks = [], []
    for i, s in enumerate(samples):
        if s.get(CLIP_KEY) is None:
            continue
        t = _tensor(s[CLIP_KEY])
        if t.dim() == 2:
            t = t[None]
        if t.dim() != 3:
            raise SampleError(f"sample {i} of the batch: {CLIP_KEY!r} has shape {tuple(t.shape)}; expected "
                              "(n_mels, frames) for one clip or (clips, n_mels, frames)", i)
        mask = s.get(CLIP_MASK_KEY)
        mask = (torch.ones(t.shape[0], t.shape[2], dtype=torch.long) if mask is None
                else _clip_mask(i, mask, t.shape[0], t.shape[2]))
        feats.append(t)
        masks.append(mask)
    if not feats:
        return None
    mels = {t.shape[1] for t in feats}
    if len(mels) > 1:
        raise ValueError(f"{CLIP_KEY!r} clips have different mel-bin counts {sorted(mels)} in one batch")
    frames = max(t.shape[2] for t in feats)
    clips = sum(t.shape[0] for t in feats)
    out = torch.zeros(clips, feats[0].shape[1], frames, dtype=feats[0].dtype)
    mask_out = torch.zeros(clips, frames, dtype=torch.long)
    row = 0
    for t, m in zip(feats, masks):
        out[row:row + t.shape[0], :, :t.shape[2]] = t
        mask_out[row:row + t.shape[0], :t.shape[2]] = m
        row += t.shape[0]
    return out, mask_out


def _per_sample(samples: Sequence[Mapping], key: str) -> object:
    missing = [i for i, s in enumerate(samples) if key not in s]
    if missing:
        having = next(i for i, s in enumerate(samples) if key in s)
        raise MissingKeyError(
            f"sample {missing[0]} of the batch (of {len(samples)}) has no {key!r} key, which sample {having} has: "
            "the default collates never drop a key (NOTE [ Extra keys in the default collates ] in "
            f"evenflow.runtime.collate_extras). Give every sample a {key!r}, remove it from the samples, add it to "
            f"row_keys= if it holds per-item rows (an absent key then adds no rows), or pass your own collate_fn",
            missing[0])
    values = [s[key] for s in samples]
    # Dense tensors of one shape stack; nested, sparse or quantized ones (and subclasses) go as a list.
    if (all(type(v) is torch.Tensor and v.layout == torch.strided and not v.is_nested and not v.is_quantized
            for v in values) and len({tuple(v.shape) for v in values}) == 1):
        return torch.stack(values)
    return values
