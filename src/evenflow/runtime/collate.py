"""Default collate functions: right-padded rows, or one flattened row for padding-free attention.

Both always emit ``labels``: a sample without them trains as a causal LM on its own ``input_ids`` (padding and
packing boundaries ignored), which is exactly what the loader counts as its supervised tokens
(``LossTokenRule`` on ``input_ids`` when a sample has no ``labels``). Every other key of any sample of the batch
-- images, audio, metadata -- is collated by what it means (NOTE [ Extra keys in the default collates ] in
collate_extras.py): a batch mixing text-only, image and audio samples comes out in the layout HF multimodal
models consume, e.g. Qwen2-VL's ``pixel_values`` ``(total_patches, 1176)`` and ``image_grid_thw``
``(num_images, 3)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..planning.loss import IGNORE_INDEX
from ..planning.shard import ShardLayout
from .collate_extras import ROW_KEYS, collate_extras

__all__ = ["PadCollate", "FlatCollate", "ROW_KEYS", "TOKEN_ALIGNED_KEYS"]

TOKEN_ALIGNED_KEYS = ("mm_token_type_ids", "token_type_ids")
"""Per-token keys laid out like ``input_ids`` (padded / flattened with 0; a sample without one: all 0, i.e. text
tokens -- Qwen2-VL's ``mm_token_type_ids`` is 0 text, 1 image, 2 video)."""
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask") + TOKEN_ALIGNED_KEYS
_FLAT_KEYS = _TOKEN_KEYS + ("position_ids",)  # FlatCollate builds the packed row's own


def _multiple(*values: int | None) -> int:
    """The least common multiple of the given row multiples (``None``: 1)."""
    return math.lcm(*[v or 1 for v in values])


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` shifted left along the last dim, -100 at the end: the label each position predicts."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[..., :-1] = labels[..., 1:]
    return out


def _aligned(samples: Sequence[Mapping], lengths: Sequence[int]) -> dict[str, list[torch.Tensor]]:
    """Each token-aligned key present on some sample, as one 1-D tensor per sample (zeros where absent)."""
    out = {}
    for key in TOKEN_ALIGNED_KEYS:
        if any(key in s for s in samples):
            out[key] = [_as_long(s[key]).reshape(-1) if key in s else torch.zeros(n, dtype=torch.long)
                        for s, n in zip(samples, lengths)]
            for i, (t, n) in enumerate(zip(out[key], lengths)):
                if len(t) != n:
                    raise ValueError(f"sample {i} of the batch: {key!r} has {len(t)} entries but 'input_ids' has "
                                     f"{n}; a per-token key must align with the tokens")
    return out


def _as_long(x) -> torch.Tensor:
    return x.to(torch.long) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.long)


@dataclass(frozen=True, kw_only=True)
class PadCollate:
    """Right-pad ``input_ids`` / ``labels`` / ``attention_mask`` into ``[batch, max_len]`` tensors.

    ``max_len`` is rounded up to ``pad_to_multiple_of`` -- the same shape the planner costs. Labels pad with
    -100 so padding never counts as a supervised token. Two samples of lengths 3 and 1:

        input_ids      [[a, b, c], [d, 0, 0]]
        attention_mask [[1, 1, 1], [1, 0, 0]]
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    row_keys: tuple[str, ...] = ROW_KEYS
    """Keys holding per-item rows (images, audio frames), concatenated along dim 0; a sample without one adds
    no rows (NOTE [ Extra keys in the default collates ])."""
    shard: ShardLayout | None = None
    """Shard-ready rows for a CP/SP group (NOTE [ Shard-ready rows ] in evenflow.planning.shard): the width a
    multiple of ``2 x cp`` / ``sp``, plus ``position_ids`` and pre-shifted ``shift_labels``."""

    def __call__(self, samples: Sequence[Mapping]) -> dict:
        ids = [_as_long(s["input_ids"]).reshape(-1) for s in samples]
        width = max(len(x) for x in ids)
        multiple = _multiple(self.pad_to_multiple_of, self.shard and self.shard.unit)
        width = -(-width // multiple) * multiple
        input_ids = torch.full((len(ids), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, :len(x)] = x
            attention[row, :len(x)] = 1
        # Labels pad with -100; a sample without labels is supervised on its own input_ids (the loader counted
        # its loss tokens from them), so a labels-free dataset trains as a causal LM.
        labels = torch.full((len(ids), width), IGNORE_INDEX, dtype=torch.long)
        for row, s in enumerate(samples):
            lab = _as_long(s["labels"]).reshape(-1) if "labels" in s else ids[row]
            labels[row, :len(lab)] = lab
        out = {"input_ids": input_ids, "attention_mask": attention, "labels": labels}
        for key, values in _aligned(samples, [len(x) for x in ids]).items():
            out[key] = torch.zeros((len(ids), width), dtype=torch.long)
            for row, v in enumerate(values):
                out[key][row, :len(v)] = v
        if self.shard is not None:
            out["position_ids"] = torch.arange(width, dtype=torch.long).expand(len(ids), width).clone()
            out["shift_labels"] = _shifted(labels)
        out.update(collate_extras(samples, _TOKEN_KEYS, self.row_keys))
        return out


@dataclass(frozen=True, kw_only=True)
class FlatCollate:
    """Concatenate samples into one ``[1, total]`` row for padding-free (varlen) attention.

    Emits what transformers' models consume for padding-free training (the layout of HF's
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): ``input_ids``, ``labels``, ``position_ids``
    restarting at 0 per sequence -- from which sdpa/eager attention build a block-diagonal mask -- and the
    flash-attention kwargs ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 cumulative lengths) and
    ``max_length_q``/``max_length_k``. No ``attention_mask``: HF only detects packed rows without one. Lengths 3, 2:

        input_ids     [[a, b, c, d, e]]
        labels        [[-100, b, c, -100, e]]
        position_ids  [[0, 1, 2, 0, 1]]
        cu_seq_lens_q [0, 3, 5]          max_length_q 3

    The first label of every sequence is -100, so the last token of one sequence never learns to predict the
    first token of the next.

    NOTE [ Packing and the KV cache ]
        An HF decoder whose config says ``use_cache=True`` (the default) builds a cache in every forward,
        training included, and with a cache its mask code skips the packed-sequence detection: the packed
        sequences silently attend to each other (loss off in the 3rd decimal on a tiny Qwen3). So the batch
        carries ``use_cache=False`` (``use_cache=None`` leaves the key out, for models that take no such
        argument; then pass it yourself or set ``model.config.use_cache = False``).
    """

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    use_cache: bool | None = False
    """Value of the batch's ``use_cache`` entry (NOTE [ Packing and the KV cache ]); ``None``: no such entry."""
    row_keys: tuple[str, ...] = ROW_KEYS
    """As [`PadCollate.row_keys`][PadCollate.row_keys]."""
    shard: ShardLayout | None = None
    """Shard-ready rows for a CP/SP group (NOTE [ Shard-ready rows ] in evenflow.planning.shard): under
    ``"ring"`` every document padded to a multiple of ``2 x cp`` (its padding continues its positions and is in
    its segment), under ``"ulysses"`` the row to a multiple of ``sp``; adds pre-shifted ``shift_labels`` and
    ``cu_seqlens_padded`` / ``cu_seqlens_unpadded`` (int32; the ``cu_seq_lens_q/k`` kernels use are the padded
    ones)."""

    def __post_init__(self) -> None:
        if self.use_cache:
            raise ValueError("FlatCollate(use_cache=True) would let packed sequences attend to each other in HF "
                             "models (NOTE [ Packing and the KV cache ]); use False, or None to omit the key")

    def __call__(self, samples: Sequence[Mapping]) -> dict:
        ids = [_as_long(s["input_ids"]).reshape(-1) for s in samples]
        labels = []
        for s, x in zip(samples, ids):
            lab = _as_long(s["labels"]).reshape(-1).clone() if "labels" in s else x.clone()
            lab[0] = IGNORE_INDEX
            labels.append(lab)
        lengths = [len(x) for x in ids]
        real = list(lengths)
        aligned = _aligned(samples, lengths)
        positions = [torch.arange(n, dtype=torch.long) for n in lengths]
        if self.shard is not None and self.shard.style == "ring":
            for i, n in enumerate(real):  # each document padded inside its own segment (NOTE [ Shard-ready rows ])
                extra = self.shard.document_length(n) - n
                ids[i] = torch.cat([ids[i], torch.full((extra,), self.pad_token_id, dtype=torch.long)])
                labels[i] = torch.cat([labels[i], torch.full((extra,), IGNORE_INDEX, dtype=torch.long)])
                positions[i] = torch.arange(n + extra, dtype=torch.long)
                for values in aligned.values():
                    values[i] = torch.cat([values[i], torch.zeros(extra, dtype=torch.long)])
                lengths[i] = n + extra
        total = sum(lengths)
        multiple = _multiple(self.pad_to_multiple_of, self.shard and self.shard.unit)
        pad = -(-total // multiple) * multiple - total
        if pad:
            # Padding is one extra "sequence" (positions restart at 0) the loss ignores; cu_seq_lens covers it so
            # kernels stay in bounds, and the position restart keeps it out of the last real sequence's attention.
            ids.append(torch.full((pad,), self.pad_token_id, dtype=torch.long))
            labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
            positions.append(torch.arange(pad, dtype=torch.long))
            lengths.append(pad)
            for values in aligned.values():
                values.append(torch.zeros(pad, dtype=torch.long))
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        longest = max(lengths)
        out = {
            "input_ids": torch.cat(ids)[None],
            "labels": torch.cat(labels)[None],
            "position_ids": torch.cat(positions)[None],
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu.clone(),
            "max_length_q": longest,
            "max_length_k": longest,
        }
        out.update({key: torch.cat(values)[None] for key, values in aligned.items()})
        if self.shard is not None:  # labels shifted per segment: no shard needs its neighbour's first label
            out["shift_labels"] = torch.cat([_shifted(lab) for lab in labels])[None]
            out["cu_seqlens_padded"] = cu.clone()
            out["cu_seqlens_unpadded"] = torch.tensor([0] + real, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        if self.use_cache is not None:
            out["use_cache"] = self.use_cache
        out.update(collate_extras(samples, _FLAT_KEYS, self.row_keys))
        return out
