"""Qwen2-VL and Qwen2.5-VL (images and videos) through the [`VLMAdapter`][evenflow.vlm.base.VLMAdapter] point.

What the stock model does, and what the adapter relies on (checked by tests/test_vlm_facts.py):

- The vision tower ``visual(rows, grid_thw=g).pooler_output`` gives ``t*h*w // merge**2`` rows per item, each
  item from its own rows only (Qwen2.5-VL's window attention included), and a video of grid ``(t, h, w)``
  encodes exactly as ``t`` frames of ``(1, h, w)``: images, videos and time slices of videos are items of one
  ``"vision"`` phase, with metadata ``(kind, t, h, w)``. The grid is required (the same rows as ``(1, 12, 16)``
  and ``(1, 16, 12)`` differ), so it travels with the item.
- M-RoPE positions come from ``get_rope_index`` on one example's own ids, modality types and grids (equal to
  the batched result): computed on the source rank, they travel with the tokens (``position_ids``, 3 columns).
- ``forward(..., mm_encoder_outputs={"image": ..., "video": ...}, position_ids=...)`` merges precomputed
  encoder outputs into the placeholders (in reading order) and runs the text model. Packed rows take
  ``position_ids`` ``[4, 1, N]``: row 0 each example's own ``0..L-1`` (how the model keeps the examples apart;
  the 3 M-RoPE rows alone let them attend to each other), rows 1-3 M-RoPE.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from ..balance.phases import PhaseSpec
from ..errors import ExampleError
from ..exchange import ExampleInputs, LLMInputs
from .base import LLMBatch, VLMAdapter, phase_cost, split_examples, transformer_cost
from .config import VLMConfig

__all__ = ["QwenVLAdapter", "KIND_IMAGE", "KIND_VIDEO", "Found", "vision_item_cost"]

KIND_IMAGE = 0
"""``kind`` of an image item (a vision item's first metadata integer)."""
KIND_VIDEO = 1
"""``kind`` of a video item (a vision item's first metadata integer)."""
PHASE = "vision"


@dataclass
class Found:
    """One example's media as [`QwenVLAdapter._example_items()`][QwenVLAdapter._example_items] found them: per phase its
    items and their metadata in placeholder order, and what its positions need (grids per kind, seconds per video,
    frames per audio clip)."""

    items: dict[str, list[torch.Tensor]]
    metas: dict[str, list[tuple[int, ...]]]
    grids: dict[int, list[tuple[int, int, int]]] = field(default_factory=lambda: {KIND_IMAGE: [], KIND_VIDEO: []})
    seconds: list[float | None] = field(default_factory=list)
    audio_frames: list[int] = field(default_factory=list)


def vision_item_cost(frame_cost: Callable[[np.ndarray], np.ndarray], meta: np.ndarray) -> np.ndarray:
    """Cost of vision items with metadata ``(kind, t, h, w)``: ``t * frame_cost(h * w)``. The tower attends
    within frames (cu_seqlens per temporal patch), so a video costs its frames, not one long item."""
    return meta[:, 1] * np.asarray(frame_cost((meta[:, 2] * meta[:, 3]).astype(np.float64)))


def _grid_tensor(grids: Sequence[tuple[int, int, int]]) -> torch.Tensor | None:
    return torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None


def _runs(mask: torch.Tensor) -> list[int]:
    """Lengths of the runs of True: ``[0, 1, 1, 0, 1]`` -> ``[2, 1]``."""
    m = mask.to(torch.int8).reshape(-1)
    if not m.numel():
        return []
    edges = torch.diff(torch.cat([m.new_zeros(1), m, m.new_zeros(1)]))
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return (ends - starts).tolist()


def _vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)  # transformers 5 moved it inside
    return tower if isinstance(tower, torch.nn.Module) else None


class QwenVLAdapter(VLMAdapter):
    """Qwen2-VL / Qwen2.5-VL: one ``"vision"`` phase (images, videos, video time slices) and M-RoPE positions."""

    MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        config = getattr(model, "config", None)
        return (getattr(config, "model_type", None) in cls.MODEL_TYPES and _vision_tower(model) is not None
                and callable(getattr(getattr(model, "model", None), "get_rope_index", None)))

    def __init__(self, model: torch.nn.Module, config: VLMConfig = VLMConfig()) -> None:
        if not self.supports(model):
            raise ValueError(f"{type(model).__name__} is not a {' / '.join(self.MODEL_TYPES)} model with the APIs "
                             f"{type(self).__name__} calls (a vision tower, get_rope_index); pass the unwrapped "
                             "Hugging Face model")
        if "mm_encoder_outputs" not in inspect.signature(model.forward).parameters:
            raise ImportError(f"{type(model).__name__}.forward takes no mm_encoder_outputs= (precomputed encoder "
                              "outputs), which the balanced step hands it; upgrade transformers (it appeared in 5.x)")
        cfg, vision = model.config, model.config.vision_config
        self.model = model
        self.visual = _vision_tower(model)
        self.merge = int(vision.spatial_merge_size)
        self.unit = self.merge ** 2
        self.image_token_id, self.video_token_id = int(cfg.image_token_id), int(cfg.video_token_id)
        self.input_dim = int(vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
        self.text_hidden = int(cfg.text_config.hidden_size)
        self.hidden_size = self.text_hidden * self._rows_per_token()
        self.video_slice = config.video_slice
        rope = inspect.signature(model.model.get_rope_index).parameters
        self._rope_takes_types = "mm_token_type_ids" in rope
        self._rope_takes_seconds = "second_per_grid_ts" in rope
        width = int(getattr(vision, "embed_dim", None) or vision.hidden_size)  # Qwen2-VL: embed_dim; 2.5: hidden_size
        self.frame_cost = phase_cost(config.time_cost, PHASE, config.encoder_cost or transformer_cost(width))
        self.llm_cost = phase_cost(config.time_cost, "llm", config.llm_cost or transformer_cost(self.text_hidden))
        self.phases = {PHASE: PhaseSpec(cost=self.frame_cost, input_dim=self.input_dim, downsample=self.unit,
                                        meta_width=4, output_rows=self._out_rows, item_cost=self._item_cost,
                                        max_rows_per_rank=config.max_encoder_rows, balance=config.balance_config,
                                        balanced=config.balance == "full")}
        self.token_fields = {"position_ids": 3}
        self.pad_token_id = int(getattr(cfg.text_config, "pad_token_id", None) or 0)

    def _rows_per_token(self) -> int:
        """Vectors of ``text_hidden`` the tower gives per merged token (Qwen3-VL's deepstack: more than one)."""
        return 1

    # -- the planner's view of an item -------------------------------------------------------------------------
    def _out_rows(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        return meta[:, 1] * meta[:, 2] * meta[:, 3] // self.unit

    def _item_cost(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        return vision_item_cost(self.frame_cost, meta)

    # -- found and positioned ----------------------------------------------------------------------------------
    def _sources(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch's media, each handed out item by item in batch order (one entry per kind of item)."""
        return {"image": _Media(batch, "pixel_values", "image_grid_thw", None, "image"),
                "video": _Media(batch, "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video")}

    def _example_items(self, ids: torch.Tensor, fail: Callable[[str], ExampleError], sources: Mapping[str, Any]
                       ) -> Found:
        """One example's items in placeholder order, each kind's placeholder runs matched to the next item of
        its kind: images, then videos (each kind is merged into its own placeholders)."""
        found = Found(items={PHASE: []}, metas={PHASE: []})
        kinds = ((KIND_IMAGE, "image", self.image_token_id), (KIND_VIDEO, "video", self.video_token_id))
        for kind, name, token in kinds:
            for k, tokens in enumerate(_runs(ids == token)):
                rows, grid, second = sources[name].take(fail, k, tokens, self.unit, self.merge)
                found.grids[kind].append(grid)
                if kind == KIND_VIDEO:
                    found.seconds.append(second)
                t, h, w = grid
                step = t if kind == KIND_IMAGE or self.video_slice is None else self.video_slice
                for t0 in range(0, t, step):  # time slices encode exactly as the whole (frames independent)
                    n = min(step, t - t0)
                    found.items[PHASE].append(rows[t0 * h * w:(t0 + n) * h * w])
                    found.metas[PHASE].append((kind, n, h, w))
        return found

    def find_items(self, batch: Mapping[str, Any], *, samples: int | None = None,
                   sample_ids: Sequence[int] | None = None) -> list[ExampleInputs]:
        sources = self._sources(batch)
        types_in = batch.get("mm_token_type_ids")
        out = []
        for j, (ids, labels, where, row) in enumerate(split_examples(batch, samples=samples)):
            index = int(sample_ids[j]) if sample_ids is not None and j < len(sample_ids) else None

            def fail(message: str, j: int = j, index: int | None = index) -> ExampleError:
                return ExampleError(message, example=j, sample_index=index)

            types = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
            if types_in is not None and not torch.equal(types_in[row, where].to(types.dtype), types):
                raise fail("mm_token_type_ids do not mark exactly its image (1) and video (2) placeholder tokens; "
                           "they decide its M-RoPE positions, so build them from the same ids")
            found = self._example_items(ids, fail, sources)
            media_meta = {p: m for p, m in found.metas.items() if self.phases[p].meta_width}
            example = ExampleInputs(input_ids=ids, labels=labels, media=found.items, media_meta=media_meta)
            example.token_fields = {"position_ids": self._positions(ids, types, found)}
            out.append(example)
        for source in sources.values():
            source.check_consumed(len(out) - 1, sample_ids[len(out) - 1] if sample_ids and out else None)
        return out

    def _positions(self, ids: torch.Tensor, types: torch.Tensor, found: Found) -> torch.Tensor:
        """``[L, 3]`` M-RoPE positions of one example, from the stock ``get_rope_index`` on its own data."""
        grids, seconds = found.grids, found.seconds
        kwargs = {"image_grid_thw": _grid_tensor(grids[KIND_IMAGE]), "video_grid_thw": _grid_tensor(grids[KIND_VIDEO])}
        if self._rope_takes_types:
            kwargs["mm_token_type_ids"] = types[None]
        if self._rope_takes_seconds and seconds and all(s is not None for s in seconds):
            kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float64)
        positions, _ = self.model.model.get_rope_index(ids[None].cpu(), **kwargs)
        return positions[:, 0].T.contiguous().to(torch.long)

    # -- encoded ---------------------------------------------------------------------------------------------
    def _tower_rows(self, out: Any) -> torch.Tensor:
        """The rows the LLM consumes from one call of the vision tower (one per merged token)."""
        return out.pooler_output

    def encode(self, phase: str, rows: torch.Tensor, item_rows: Sequence[int], item_meta: torch.Tensor
               ) -> torch.Tensor:
        if phase != PHASE:
            raise ValueError(f"{type(self).__name__} has no encoder phase {phase!r}; its phases: {list(self.phases)}")
        dtype = next(self.visual.parameters()).dtype
        if not len(item_rows):
            # The stock tower cannot run on zero rows; one dummy item of the smallest grid keeps every vision
            # parameter in this rank's graph (DDP/FSDP) and is weighted 0.
            grid = torch.tensor([[1, self.merge, self.merge]], dtype=torch.long, device=rows.device)
            dummy = self._tower_rows(self.visual(rows.new_zeros(self.unit, self.input_dim).to(dtype), grid_thw=grid))
            return dummy[:0] + 0 * dummy.sum()
        grids = item_meta[:, 1:4].to(device=rows.device, dtype=torch.long)
        if int(grids.prod(dim=1).sum()) != rows.shape[0]:
            raise ValueError(f"{len(item_rows)} vision items with grids {grids.tolist()} need "
                             f"{int(grids.prod(dim=1).sum())} patch rows, {rows.shape[0]} arrived")
        return self._tower_rows(self.visual(rows.to(dtype), grid_thw=grids))

    def warmup_item(self, phase: str, rows: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """One frame of about ``rows`` patch rows (a square grid of whole merged tokens), for a cost fit."""
        if phase != PHASE:
            raise ValueError(f"{type(self).__name__} has no encoder phase {phase!r}")
        side = max(self.merge, int(round(rows ** 0.5 / self.merge)) * self.merge)
        return (torch.zeros(side * side, self.input_dim), [side * side],
                torch.tensor([[KIND_IMAGE, 1, side, side]], dtype=torch.long))

    # -- merged ----------------------------------------------------------------------------------------------
    def _vision_outputs(self, parts: Sequence[torch.Tensor], empty: torch.Tensor) -> Any:
        """What ``mm_encoder_outputs`` holds for one kind: its items' rows in reading order."""
        return BaseModelOutputWithPooling(pooler_output=(torch.cat(list(parts)) if parts else empty,))

    def _call(self, model: torch.nn.Module, llm: LLMInputs, batch: LLMBatch, merged: dict[str, Any],
              position_ids: torch.Tensor) -> Any:
        """The stock forward on this rank's LLM batch with the merged encoder outputs."""
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                     mm_encoder_outputs=merged, use_cache=False)

    def forward(self, model: torch.nn.Module, llm: LLMInputs, batch: LLMBatch) -> torch.Tensor:
        media = llm.media[PHASE]
        sizes, kinds = llm.media_item_rows[PHASE], llm.media_item_meta[PHASE][:, 0].tolist()
        parts = torch.split(media, sizes) if sizes else ()
        # Empty image / video outputs are passed too: the merge then ties the received rows into this rank's
        # graph even when it consumes none (the all-to-all backward needs every rank; DDP's unused-parameter
        # search starts from the forward's outputs).
        merged = {name: self._vision_outputs([p for p, k in zip(parts, kinds) if k == kind], media[:0])
                  for name, kind in (("image", KIND_IMAGE), ("video", KIND_VIDEO))}
        mrope = batch.fields["position_ids"].permute(2, 0, 1)  # [3, rows, tokens]
        if batch.layout == "packed":
            position_ids = torch.cat([batch.example_positions[None], mrope])  # [4, 1, N]
        else:
            position_ids = mrope
        return self._call(model, llm, batch, merged, position_ids).logits


class _Media:
    """One media kind of a collated batch, handed out item by item in batch order."""

    def __init__(self, batch: Mapping[str, Any], rows_key: str, grid_key: str, seconds_key: str | None,
                 name: str, *, frames: bool = False) -> None:
        self.rows = batch.get(rows_key)
        grid = batch.get(grid_key)
        self.grids = [] if grid is None else torch.as_tensor(grid).reshape(-1, 3).tolist()
        seconds = batch.get(seconds_key) if seconds_key else None
        self.seconds = None if seconds is None else torch.as_tensor(seconds).reshape(-1).tolist()
        if frames:  # one placeholder run per temporal patch (Qwen3-VL): each is an item of grid (1, h, w)
            self.seconds = None if self.seconds is None else [s for (t, _, _), s in zip(self.grids, self.seconds)
                                                              for _ in range(int(t))]
            self.grids = [[1, h, w] for t, h, w in self.grids for _ in range(int(t))]
        self.rows_key, self.grid_key, self.name = rows_key, grid_key + (" (one per frame)" if frames else ""), name
        self.next_item, self.next_row = 0, 0

    def take(self, fail, k: int, tokens: int, unit: int, merge: int) -> tuple[torch.Tensor, tuple, float | None]:
        if self.next_item >= len(self.grids):
            raise fail(f"its {self.name} {k} has a placeholder run of {tokens} tokens but the batch's {self.grid_key} "
                       f"has only {len(self.grids)} grids; every placeholder run needs its grid")
        t, h, w = (int(v) for v in self.grids[self.next_item])
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise fail(f"{self.name} {k} has grid {(t, h, w)}: h and w must be positive multiples of "
                       f"spatial_merge_size={merge}")
        rows = t * h * w
        if rows // unit != tokens:
            raise fail(f"{self.name} {k} has grid {(t, h, w)} = {rows} patch rows -> {rows // unit} tokens, but its "
                       f"placeholder run has {tokens}; the grid does not belong to this {self.name}")
        available = 0 if self.rows is None else self.rows.shape[0] - self.next_row
        if available < rows:
            raise fail(f"{self.name} {k} has grid {(t, h, w)} = {rows} patch rows, but {self.rows_key} has only "
                       f"{available} rows left")
        out = self.rows[self.next_row:self.next_row + rows]
        second = self.seconds[self.next_item] if self.seconds is not None and self.next_item < len(self.seconds) \
            else None
        self.next_item += 1
        self.next_row += rows
        return out, (t, h, w), second

    def check_consumed(self, last: int, index: int | None) -> None:
        total = 0 if self.rows is None else self.rows.shape[0]
        if self.next_item != len(self.grids) or self.next_row != total:
            raise ExampleError(f"the batch's {self.grid_key} has {len(self.grids)} grids for {total} "
                               f"{self.rows_key} rows, its placeholders used {self.next_item} grids and "
                               f"{self.next_row} rows; a grid does not match its rows", example=max(last, 0),
                               sample_index=index)
