"""The Qwen2.5-Omni thinker (audio, images, videos) through the [`VLMAdapter`][evenflow.vlm.base.VLMAdapter] point.

The thinker is a Qwen2.5-VL (its vision tower, M-RoPE, ``mm_encoder_outputs=`` for images and videos) with a
Whisper-style audio tower: two phases, ``"vision"`` ([`QwenVLAdapter`][evenflow.vlm.QwenVLAdapter]'s) and
``"audio"``. What the stock model does, and what the adapter relies on (tests/test_vlm_facts.py):

- ``thinker.model.audio_tower(feats [n_mels, sum of frames], feature_lens=frames per clip)`` encodes clips
  independently; a clip of ``F`` mel frames gives [`audio_output_rows()`][audio_output_rows] ``(F)`` rows -- ``F // 4``
  only when ``F % 4 != 3`` -- which is also how many ``<|AUDIO|>`` placeholders its example holds.
- The stock forward takes image and video outputs precomputed (``mm_encoder_outputs=``) but not audio: it
  would run the tower on ``input_features`` itself. So the adapter merges audio on its own: a forward hook on
  the input embedding, installed for the one call, writes the routed audio rows over the ``<|AUDIO|>``
  embeddings in reading order -- what the stock ``masked_scatter`` does -- inside the stock forward, so DDP and
  FSDP see an ordinary forward.
- Positions come from the thinker's own ``get_rope_index`` (another signature than Qwen2.5-VL's:
  ``audio_seqlens``, ``use_audio_in_video``, ``second_per_grids``), per example on its source rank.
- ``audio_tower.audio_bos_eos_token`` is never used by the forward: it gets no gradient, balanced or not.

NOTE [ Exact audio cuts ]
    The audio tower cuts every clip into windows of ``2 * n_window`` mel frames and runs its two convolutions
    and its attention inside each window on its own (positions restart per window); only the final
    stride-2 average pooling pairs rows across the whole clip. A window of ``2 * n_window`` frames leaves
    ``n_window`` rows after the stride-2 convolution, so when ``n_window`` is even no pooled pair straddles a
    window boundary, and a clip cut at multiples of ``2 * n_window`` frames encodes piece by piece into exactly
    the rows of the whole (the output lengths add up: ``n_window * k / 2`` per ``k`` full windows, the tail's
    own rule for the rest). Cut anywhere else, or at ``2 * n_window`` with an odd ``n_window``, and the pieces
    differ from the whole (pairs straddle; windows shift): the cut unit is ``2 * n_window`` frames, doubled when
    ``n_window`` is odd. Example (``n_window = 100``): a 30 s clip, 3,000 frames, cut into 15 items of 200
    frames (``audio_slice=1``) or 2 items of 2,000 and 1,000 (``audio_slice=10``); 750 rows either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..balance.phases import PhaseSpec
from ..errors import ExampleError
from ..exchange import LLMInputs
from .base import LLMBatch, phase_cost, transformer_cost
from .config import VLMConfig
from .qwen2_vl import KIND_IMAGE, KIND_VIDEO, Found, QwenVLAdapter, _grid_tensor, _Media, _runs

__all__ = ["QwenOmniAdapter", "audio_output_rows", "audio_item_cost", "AUDIO"]

AUDIO = "audio"
"""The audio phase's name."""
SECONDS_KEYS = ("video_second_per_grid", "second_per_grid_ts")
"""Batch keys of a video's seconds per temporal patch (the thinker's forward names it the first way)."""


def audio_output_rows(frames: np.ndarray) -> np.ndarray:
    """Rows the Qwen2.5-Omni audio tower gives for clips of ``frames`` mel frames: a stride-2 convolution, then a
    stride-2 pooling of pairs. ``[8, 35, 2] -> [2, 9, 0]`` (``35 // 4`` would be 8)."""
    after_conv = (np.asarray(frames, dtype=np.int64) - 1) // 2 + 1
    return np.maximum((after_conv - 2) // 2 + 1, 0)


def audio_item_cost(window_cost: Callable[[np.ndarray], np.ndarray], window: int, frames: np.ndarray) -> np.ndarray:
    """Cost of audio items of ``frames`` mel frames: the tower attends within windows of ``window`` frames, so an
    item costs its full windows and its tail, each at the window cost of its length."""
    frames = np.asarray(frames, dtype=np.int64)
    full, tail = frames // window, frames % window
    per_window = float(np.asarray(window_cost(np.float64(window))))
    return full * per_window + np.where(tail > 0, window_cost(tail.astype(np.float64)), 0.0)


def _audio_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    tower = getattr(getattr(model, "model", None), "audio_tower", None)
    return tower if isinstance(tower, torch.nn.Module) else None


class _Clips:
    """The batch's audio clips (``input_features`` ``[clips, n_mels, frames]`` with ``feature_attention_mask``),
    handed out clip by clip in batch order as ``[frames, n_mels]`` rows."""

    def __init__(self, batch: Mapping[str, Any]) -> None:
        feats, mask = batch.get("input_features"), batch.get("feature_attention_mask")
        self.feats = feats
        self.frames: list[int] = []
        if feats is not None:
            if feats.ndim != 3:
                raise ExampleError(f"input_features has shape {tuple(feats.shape)}; expected [clips, n_mels, frames] "
                                   "(PadCollate's layout of the feature extractor's clips)", example=0)
            mask = torch.ones(feats.shape[0], feats.shape[2], dtype=torch.long) if mask is None else mask
            for c in range(feats.shape[0]):
                n = int(mask[c].sum())
                if not bool(mask[c, :n].all()):
                    raise ExampleError(f"feature_attention_mask of clip {c} is not a prefix of ones; pad clips on the "
                                       "right (PadCollate)", example=0)
                self.frames.append(n)
        self.next = 0

    def take(self, fail: Callable[[str], ExampleError], k: int, tokens: int) -> torch.Tensor:
        if self.next >= len(self.frames):
            raise fail(f"its audio clip {k} has a placeholder run of {tokens} tokens but the batch's input_features "
                       f"has only {len(self.frames)} clips; every run of <|AUDIO|> needs its clip")
        frames = self.frames[self.next]
        rows = int(audio_output_rows(np.array([frames]))[0])
        if rows != tokens:
            raise fail(f"audio clip {k} has {frames} mel frames -> {rows} audio rows, but its placeholder run has "
                       f"{tokens}; the clip does not belong to these placeholders")
        out = self.feats[self.next, :, :frames].T
        self.next += 1
        return out

    def check_consumed(self, last: int, index: int | None) -> None:
        if self.next != len(self.frames):
            raise ExampleError(f"the batch holds {len(self.frames)} audio clips, its placeholders used {self.next}",
                               example=max(last, 0), sample_index=index)


class QwenOmniAdapter(QwenVLAdapter):
    """The Qwen2.5-Omni thinker: a ``"vision"`` phase (images, videos, time slices) and an ``"audio"`` phase
    (clips, or pieces of clips cut at the tower's windows: ``VLMConfig.audio_slice``)."""

    MODEL_TYPES = ("qwen2_5_omni_thinker",)

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        tower = _audio_tower(model)
        return (super().supports(model) and tower is not None
                and all(hasattr(tower, name) for name in ("n_window", "conv1")))

    def __init__(self, model: torch.nn.Module, config: VLMConfig = VLMConfig()) -> None:
        super().__init__(model, config)
        cfg = model.config
        self.audio_tower = _audio_tower(model)
        self.audio_token_id = int(cfg.audio_token_id)
        audio = cfg.audio_config
        self.n_mels = int(audio.num_mel_bins)
        n_window = int(self.audio_tower.n_window)
        self.window = 2 * n_window
        """Frames the tower attends within (and positions restart at)."""
        self.cut = self.window * (1 if n_window % 2 == 0 else 2)  # NOTE [ Exact audio cuts ]
        self.audio_slice = config.audio_slice
        self.window_cost = phase_cost(config.time_cost, AUDIO, transformer_cost(int(audio.d_model)))
        self.phases[AUDIO] = PhaseSpec(cost=self.window_cost, input_dim=self.n_mels, output_rows=self._audio_rows,
                                       item_cost=self._audio_cost, balance=config.balance_config,
                                       balanced=config.balance == "full")

    # -- the planner's view of an audio item -------------------------------------------------------------------
    def _audio_rows(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        return audio_output_rows(rows)

    def _audio_cost(self, rows: np.ndarray, meta: np.ndarray) -> np.ndarray:
        return audio_item_cost(self.window_cost, self.window, rows)

    # -- found and positioned ----------------------------------------------------------------------------------
    def _sources(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        seconds = next((k for k in SECONDS_KEYS if batch.get(k) is not None), None)
        return {"image": _Media(batch, "pixel_values", "image_grid_thw", None, "image"),
                "video": _Media(batch, "pixel_values_videos", "video_grid_thw", seconds, "video"),
                AUDIO: _Clips(batch)}

    def _example_items(self, ids: torch.Tensor, fail: Callable[[str], ExampleError], sources: Mapping[str, Any]
                       ) -> Found:
        found = super()._example_items(ids, fail, sources)
        if found.grids[KIND_VIDEO] and any(s is None for s in found.seconds):
            raise fail(f"it has a video but the batch has no {' or '.join(SECONDS_KEYS)}: the thinker's M-RoPE "
                       "positions need each video's seconds per temporal patch (the processor's "
                       "video_second_per_grid)")
        found.items[AUDIO], found.metas[AUDIO] = [], []
        piece = self.cut * self.audio_slice if self.audio_slice else None
        for k, tokens in enumerate(_runs(ids == self.audio_token_id)):
            rows = sources[AUDIO].take(fail, k, tokens)
            found.audio_frames.append(int(rows.shape[0]))
            step = piece or rows.shape[0]
            for f0 in range(0, rows.shape[0], step):  # NOTE [ Exact audio cuts ]
                found.items[AUDIO].append(rows[f0:f0 + step])
                found.metas[AUDIO].append(())
        return found

    def _positions(self, ids: torch.Tensor, types: torch.Tensor, found: Found) -> torch.Tensor:
        grids = found.grids
        positions, _ = self.model.model.get_rope_index(
            ids[None].cpu(), image_grid_thw=_grid_tensor(grids[KIND_IMAGE]),
            video_grid_thw=_grid_tensor(grids[KIND_VIDEO]), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
            use_audio_in_video=False,
            audio_seqlens=torch.tensor(found.audio_frames, dtype=torch.long) if found.audio_frames else None,
            second_per_grids=torch.tensor(found.seconds, dtype=torch.float64) if found.seconds else None)
        return positions[:, 0].T.contiguous().to(torch.long)

    # -- encoded ---------------------------------------------------------------------------------------------
    def encode(self, phase: str, rows: torch.Tensor, item_rows: Sequence[int], item_meta: torch.Tensor
               ) -> torch.Tensor:
        if phase != AUDIO:
            return super().encode(phase, rows, item_rows, item_meta)
        dtype = next(self.audio_tower.parameters()).dtype
        if not len(item_rows):
            # Like the vision tower, the audio tower cannot run on zero frames: one dummy clip of 4 frames (one
            # output row) keeps every parameter it uses in this rank's graph, weighted 0.
            dummy = self.audio_tower(rows.new_zeros(self.n_mels, 4).to(dtype),
                                     feature_lens=torch.tensor([4], device=rows.device)).last_hidden_state
            return dummy[:0] + 0 * dummy.sum()
        lens = torch.tensor(list(item_rows), dtype=torch.long, device=rows.device)
        return self.audio_tower(rows.to(dtype).T, feature_lens=lens).last_hidden_state

    def warmup_item(self, phase: str, rows: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Vision: as [`QwenVLAdapter.warmup_item()`][QwenVLAdapter.warmup_item]; audio: one clip of ``rows`` mel
        frames."""
        if phase != AUDIO:
            return super().warmup_item(phase, rows)
        frames = max(4, int(rows))
        return torch.zeros(frames, self.n_mels), [frames], torch.zeros(1, 0, dtype=torch.long)

    def unused_parameters(self) -> list[str]:
        return [f"{name}.weight" for name, module in self.model.named_modules()
                if module is getattr(self.audio_tower, "audio_bos_eos_token", None)]

    # -- merged ----------------------------------------------------------------------------------------------
    def _call(self, model: torch.nn.Module, llm: LLMInputs, batch: LLMBatch, merged: dict[str, Any],
              position_ids: torch.Tensor) -> Any:
        audio = llm.media[AUDIO]
        mask = (batch.input_ids == self.audio_token_id)[..., None]
        if int(mask.sum()) != audio.shape[0]:
            raise ValueError(f"this rank's examples hold {int(mask.sum())} <|AUDIO|> tokens, {audio.shape[0]} audio "
                             "rows arrived for them")
        calls = []

        def merge_audio(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            # The stock merge of an audio tower's output, on the routed rows: masked_scatter in reading order.
            # Also with no audio token here, so the received rows stay in this rank's graph.
            calls.append(1)
            return output.masked_scatter(mask.to(output.device), audio.to(output.dtype))

        handle = self.model.get_input_embeddings().register_forward_hook(merge_audio)
        try:
            out = super()._call(model, llm, batch, merged, position_ids)
        finally:
            handle.remove()
        if len(calls) != 1:
            raise RuntimeError(f"the thinker's forward embedded input_ids {len(calls)} times (expected once); the "
                               "audio merge writes the audio rows into that embedding -- this transformers version "
                               "changed the thinker's forward, so the adapter cannot merge audio into it")
        return out
