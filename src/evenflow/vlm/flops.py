"""Per-phase training FLOPs of a Qwen2.5-VL / Qwen2.5-Omni-shaped model, per item, from its config. Pure.

What the simulator plans and scores with when no GPU timed the real model (NOTE [ GPU cost from FLOPs ] in
``evenflow/sim/calibrate.py`` for the LLM; the same counting for the towers): forward + backward = 3 x forward,
``2`` FLOPs per multiply-add, so ``6`` per weight per row for the dense layers and, per attention layer, ``12 * d``
per (query, key) pair (``QK^T`` and ``AV``, bidirectional in the towers, causal in the LLM).

- **Vision** (one frame of ``h x w`` patches, ``P = h * w``): the patch embedding, ``depth`` blocks and the 2x2
  merger on every patch; full attention over the frame in ``fullatt_block_indexes``, windows of
  ``window_size / patch_size`` patches a side elsewhere -- windows at the frame's right and bottom edges are
  partial, which the count follows exactly ([`vision_frame_flops()`][vision_frame_flops]) and a quadratic in ``P``
  cannot.
- **Audio** (one clip of ``F`` mel frames, Qwen2.5-Omni's tower): two convolutions, ``encoder_layers`` blocks on
  ``F / 2`` rows attending within windows of ``n_window`` rows, pooling and the projection
  ([`audio_clip_flops()`][audio_clip_flops]).
- **LLM** (one example of ``L`` tokens): ``6 N L`` for the matmul weights (LM head included) plus causal
  attention ``12 * layers * heads * head_dim * L (L + 1) / 2`` ([`llm_example_flops()`][llm_example_flops]).

The ``QWEN2_5_VL_7B`` and ``QWEN2_5_OMNI_7B_AUDIO`` shapes are the published ``config.json`` fields (random
init: nothing is loaded).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["QWEN2_5_VL_7B", "QWEN2_5_OMNI_7B_AUDIO", "vision_frame_flops", "audio_clip_flops", "llm_example_flops"]

QWEN2_5_VL_7B = {
    "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                   temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                   out_hidden_size=3584),
    "text": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, head_dim=128, vocab_size=152064),
}
"""Qwen2.5-VL-7B-Instruct's vision tower and text model (config.json)."""
QWEN2_5_OMNI_7B_AUDIO = dict(num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                             d_model=1280, n_window=100, output_dim=3584)
"""Qwen2.5-Omni-7B's audio tower (config.json ``thinker_config.audio_config``): the thinker around it is
Qwen2.5-VL-7B-shaped."""


def vision_frame_flops(h: np.ndarray, w: np.ndarray, vision: Mapping[str, object] = QWEN2_5_VL_7B["vision"]
                       ) -> np.ndarray:
    """Training FLOPs of one frame of ``h x w`` patches (arrays broadcast), windows counted exactly."""
    h, w = np.asarray(h, dtype=np.int64), np.asarray(w, dtype=np.int64)
    d, inter, depth = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["depth"])
    merge, out = int(vision["spatial_merge_size"]), int(vision["out_hidden_size"])
    patch_in = int(vision["in_channels"]) * int(vision["temporal_patch_size"]) * int(vision["patch_size"]) ** 2
    full = len(vision["fullatt_block_indexes"])
    side = int(vision["window_size"]) // int(vision["patch_size"])  # patches per window side (8 at 112 / 14)
    P = (h * w).astype(np.float64)
    per_patch = patch_in * d + depth * (4 * d * d + 3 * d * inter) + ((merge * merge * d) ** 2
                                                                       + merge * merge * d * out) / merge ** 2
    # Sum over windows of (patches in the window)^2: full windows, then the partial ones at the edges.
    rows_full, rows_tail = h // side, h % side
    cols_full, cols_tail = w // side, w % side
    win_sq = (rows_full * cols_full * side ** 4 + rows_full * (cols_tail * side) ** 2
              + cols_full * (rows_tail * side) ** 2 + (rows_tail * cols_tail) ** 2).astype(np.float64)
    return 6.0 * per_patch * P + 12.0 * d * (full * P * P + (depth - full) * win_sq)


def audio_clip_flops(frames: np.ndarray, audio: Mapping[str, object] = QWEN2_5_OMNI_7B_AUDIO) -> np.ndarray:
    """Training FLOPs of one clip of ``frames`` mel frames, window by window (``2 * n_window`` frames each)."""
    F = np.asarray(frames, dtype=np.int64)
    mels, d, ffn = int(audio["num_mel_bins"]), int(audio["d_model"]), int(audio["encoder_ffn_dim"])
    layers, out, window = int(audio["encoder_layers"]), int(audio["output_dim"]), 2 * int(audio["n_window"])
    full, tail = F // window, F % window

    def chunk(c: np.ndarray) -> np.ndarray:  # one window of c frames: c2 rows after the stride-2 convolution
        c2 = (c + 1) // 2
        dense = mels * 3 * d * c + 3 * d * d * c2 + layers * (4 * d * d + 2 * d * ffn) * c2
        return 6.0 * dense + 12.0 * d * layers * c2 * c2.astype(np.float64)

    pooled = np.maximum(((F - 1) // 2 + 1 - 2) // 2 + 1, 0)
    return full * chunk(np.full_like(F, window)) + np.where(tail > 0, chunk(tail), 0.0) + 6.0 * d * out * pooled


def llm_example_flops(tokens: np.ndarray, text: Mapping[str, object] = QWEN2_5_VL_7B["text"]) -> np.ndarray:
    """Training FLOPs of one example of ``tokens`` tokens (causal attention counted exactly)."""
    L = np.asarray(tokens, dtype=np.float64)
    layers, h, inter = int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["intermediate_size"])
    heads, kv, head_dim = int(text["num_attention_heads"]), int(text["num_key_value_heads"]), int(text["head_dim"])
    matmul = layers * (2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter) + int(text["vocab_size"]) * h
    return 6.0 * matmul * L + 12.0 * layers * heads * head_dim * L * (L + 1) / 2
