"""Qwen3-VL through the [`VLMAdapter`][evenflow.vlm.base.VLMAdapter] point: deepstack, and videos frame by frame.

What differs from Qwen2-VL, and what the adapter relies on (tests/test_vlm_facts.py):

- **Several outputs per item.** The vision tower returns, beside the merged rows (``pooler_output``), one more
  set of rows per deepstack layer (``deepstack_features``), which the text model adds to the hidden states of
  its first layers at the vision positions. All of them are per merged token and per item, so the adapter
  hands the orchestrator one row per merged token holding them side by side (``(1 + deepstack) * hidden``
  wide: ``hidden_size`` is that width) and splits the columns back in the merge -- the outputs still travel
  in the one output exchange.
- **Videos frame by frame.** Qwen3-VL writes each temporal patch of a video as its own placeholder run (a
  timestamp between them), and its ``get_rope_index`` splits ``video_grid_thw`` into one ``(1, h, w)`` grid per
  temporal patch: every frame is an item of its own (as ``video_slice=1``), encoded exactly as in the whole
  video (the tower attends within frames).
- Positions, packing (``[4, 1, N]``), ``mm_encoder_outputs=`` and ``mm_token_type_ids`` as in Qwen2-VL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .qwen2_vl import QwenVLAdapter, _Media

__all__ = ["Qwen3VLAdapter"]


def _deepstack_output_class() -> type:
    try:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures
    except ImportError as exc:  # pragma: no cover - transformers without Qwen3-VL never builds one
        raise ImportError("transformers has no Qwen3-VL deepstack output class; upgrade transformers") from exc
    return BaseModelOutputWithDeepstackFeatures


class Qwen3VLAdapter(QwenVLAdapter):
    """Qwen3-VL: one ``"vision"`` phase of images and video frames, each with its deepstack rows."""

    MODEL_TYPES = ("qwen3_vl",)

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        tower = getattr(getattr(model, "model", None), "visual", None)
        return super().supports(model) and isinstance(getattr(tower, "deepstack_visual_indexes", None),
                                                      (list, tuple))

    def _rows_per_token(self) -> int:
        return 1 + len(self.visual.deepstack_visual_indexes)

    def _sources(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        return {"image": _Media(batch, "pixel_values", "image_grid_thw", None, "image"),
                "video": _Media(batch, "pixel_values_videos", "video_grid_thw", None, "video", frames=True)}

    def _tower_rows(self, out: Any) -> torch.Tensor:
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=1)

    def _vision_outputs(self, parts: Sequence[torch.Tensor], empty: torch.Tensor) -> Any:
        rows = torch.cat(list(parts)) if parts else empty
        h = self.text_hidden
        columns = [rows[:, i * h:(i + 1) * h] for i in range(self._rows_per_token())]
        return _deepstack_output_class()(pooler_output=(columns[0],), deepstack_features=[(c,) for c in columns[1:]])
