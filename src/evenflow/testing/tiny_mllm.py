"""A tiny multimodal LM for tests and benchmarks: random init, CPU, float64-capable. Not a real model.

* vision encoder -- patch rows ``[P, patch_dim]`` -> linear + GELU -> merge ``patch_merge`` consecutive
  patches -> ``[P / patch_merge, d_model]``;
* audio encoder  -- frame rows ``[F, n_mels]`` -> linear + GELU -> stack ``frame_stride`` frames ->
  ``[F / frame_stride, d_model]``;
* causal LM      -- token embeddings where the placeholder tokens (``image_token_id``, ``audio_token_id``)
  are replaced, in reading order, by the encoder outputs; pre-norm attention + MLP blocks; one sequence
  per example (no padding), so the LLM cost of a rank is the sum over its examples.

Both encoders work row-wise within an item, so an item's output does not depend on what else is in the
batch: the gradient-invariance tests rely on that (NOTE [ Gradients do not depend on the plan ]). Every
branch runs on every call -- on zero rows when a rank has no images or audio, and on a one-token dummy with
weight 0 when it has no examples -- so every parameter gets a gradient on every rank and DDP/FSDP
collectives never diverge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..balance.costs import QuadraticCost
from ..balance.phases import OrchestratorConfig, PhaseSpec
from ..exchange import ExampleInputs, LLMInputs

__all__ = ["TinyMLLMConfig", "TinyMLLM", "TokenFold", "example_from_sample", "make_examples",
           "orchestrator_config", "real_media_config", "split_rows"]

IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class TinyMLLMConfig:
    """Sizes of the tiny model."""

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    max_len: int = 1024
    """Longest sequence (learned positions)."""
    patch_dim: int = 12
    patch_merge: int = 2
    """Patches merged into one vision token."""
    n_mels: int = 8
    frame_stride: int = 4
    """Audio frames stacked into one audio token."""
    image_token_id: int = 1
    audio_token_id: int = 2

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        ids = (self.image_token_id, self.audio_token_id)
        if min(ids) < 0 or max(ids) >= self.vocab_size or ids[0] == ids[1]:
            raise ValueError(f"image_token_id and audio_token_id must be distinct ids in [0, vocab_size="
                             f"{self.vocab_size}), got {ids}")


def real_media_config(*, vocab_size: int = 512, d_model: int = 32, n_layers: int = 2, n_heads: int = 4,
                      max_len: int = 1024) -> TinyMLLMConfig:
    """Sizes for [`evenflow.data.multimodal.MultimodalChatDataset`][evenflow.data.multimodal.MultimodalChatDataset]
    samples: Qwen2-VL patch rows (1,176 features, 2x2 merge = 4 patches per token) and Whisper log-mel frames (80 bins,
    4 frames per token)."""
    from ..data.audio import AUDIO_FRAME_STRIDE, N_MELS

    return TinyMLLMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                          max_len=max_len, patch_dim=3 * 2 * 14 * 14, patch_merge=4, n_mels=N_MELS,
                          frame_stride=AUDIO_FRAME_STRIDE, image_token_id=1, audio_token_id=2)


@dataclass(frozen=True, kw_only=True)
class TokenFold:
    """Map real (Qwen3) ids onto the tiny model's vocabulary: placeholders to the model's ids, text hashed.

    The tiny model is random-init and exists to make costs real, not to learn: text id ``t`` becomes
    ``3 + t % (vocab_size - 3)`` (lengths and supervision unchanged); ``-100`` labels stay ``-100``.
    Example with ``vocab_size=64``: Qwen3 id 151644 -> 3 + 151644 % 61 = 62.
    """

    image_pad_id: int
    """The dataset's image placeholder (Qwen3 ``<|image_pad|>``)."""
    audio_pad_id: int
    """The dataset's audio placeholder ([`evenflow.data.audio.AUDIO_PAD_ID`][evenflow.data.audio.AUDIO_PAD_ID])."""
    config: TinyMLLMConfig

    def __post_init__(self) -> None:
        if self.config.vocab_size < 4 or {self.config.image_token_id, self.config.audio_token_id} != {1, 2}:
            raise ValueError("TokenFold keeps 0 for padding, 1 and 2 for the placeholders and hashes text into "
                             "3..vocab_size-1: use image_token_id/audio_token_id in {1, 2} and vocab_size >= 4")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.config
        out = 3 + torch.remainder(ids, c.vocab_size - 3)
        out = torch.where(ids == self.image_pad_id, torch.full_like(ids, c.image_token_id), out)
        out = torch.where(ids == self.audio_pad_id, torch.full_like(ids, c.audio_token_id), out)
        return torch.where(ids == IGNORE_INDEX, ids, out)


def split_rows(rows: int, window: int | None, unit: int) -> list[int]:
    """Cut an item of ``rows`` rows into windows of at most ``window`` rows, each a multiple of ``unit``.

    ``split_rows(1000, 400, 4)`` -> ``[400, 400, 200]``; ``window=None`` keeps the item whole.
    """
    if window is None or rows <= window:
        return [rows]
    if window < unit or window % unit:
        raise ValueError(f"window={window} must be a positive multiple of {unit} (rows per output token)")
    return [window] * (rows // window) + ([rows % window] if rows % window else [])


def example_from_sample(sample: dict, fold: TokenFold, *, dtype: torch.dtype = torch.float32,
                        audio_window: int | None = None) -> ExampleInputs:
    """A [`MultimodalChatDataset`][MultimodalChatDataset] sample as orchestrator input (one image and one clip at most).

    ``audio_window``: cut a clip into items of at most that many frames (Whisper-style fixed windows), so a
    long clip can be encoded on several ranks. Exact for this model's row-wise audio encoder: the
    concatenated window outputs equal the whole clip's, in the same placeholder order.
    """
    media: dict[str, list[torch.Tensor]] = {"vision": [], "audio": []}
    if int(sample["num_patches"]):
        media["vision"].append(sample["pixel_values"].to(dtype))
    if int(sample["num_frames"]):
        frames = sample["audio_features"].to(dtype)
        sizes = split_rows(frames.shape[0], audio_window, fold.config.frame_stride)
        media["audio"].extend(torch.split(frames, sizes))
    return ExampleInputs(input_ids=fold(sample["input_ids"]), labels=fold(sample["labels"]), media=media)


class _RowEncoder(nn.Module):
    """rows -> linear + GELU -> group ``merge`` consecutive rows -> linear. Works on zero rows."""

    def __init__(self, in_dim: int, d_model: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.inp = nn.Linear(in_dim, d_model)
        self.out = nn.Linear(merge * d_model, d_model)

    def forward(self, rows: torch.Tensor, item_rows: Sequence[int]) -> torch.Tensor:
        for k, n in enumerate(item_rows):
            if n % self.merge:
                raise ValueError(f"item {k} has {n} rows, not a multiple of {self.merge}; pad or crop it")
        h = F.gelu(self.inp(rows))
        return self.out(h.reshape(-1, self.merge * h.shape[-1]))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyMLLM(nn.Module):
    """Vision encoder + audio encoder + causal LM. See the module docstring."""

    PHASES = ("vision", "audio")

    def __init__(self, config: TinyMLLMConfig = TinyMLLMConfig()) -> None:
        super().__init__()
        self.config = config
        c = config
        self.vision = _RowEncoder(c.patch_dim, c.d_model, c.patch_merge)
        self.audio = _RowEncoder(c.n_mels, c.d_model, c.frame_stride)
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_len, c.d_model)
        self.blocks = nn.ModuleList(_Block(c.d_model, c.n_heads) for _ in range(c.n_layers))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab_size)

    def encode_vision(self, rows: torch.Tensor, item_rows: Sequence[int]) -> torch.Tensor:
        return self.vision(rows, item_rows)

    def encode_audio(self, rows: torch.Tensor, item_rows: Sequence[int]) -> torch.Tensor:
        return self.audio(rows, item_rows)

    def encoders(self) -> dict:
        """Phase name -> encoder, for [`GlobalOrchestrator.step()`][GlobalOrchestrator.step] and
        [`local_step()`][local_step]."""
        return {"vision": self.encode_vision, "audio": self.encode_audio}

    def lm_loss_sum(self, batch: LLMInputs) -> torch.Tensor:
        """Summed next-token cross-entropy over supervised tokens (divide by ``batch.total_loss_tokens``).

        Each example is its own sequence (as in packed / varlen training): no padding, so an example's loss
        and its cost do not depend on what else the rank holds -- the cost is additive, as the orchestrator's
        LLM phase assumes.
        """
        c = self.config
        media = {p: batch.media[p] for p in self.PHASES}
        # Tie every encoder output into the graph, even an empty one (NOTE [ Every rank enters every collective ]).
        total = sum((0.0 * m.sum() for m in media.values()), torch.zeros((), dtype=self.head.weight.dtype,
                                                                      device=self.head.weight.device))
        if not batch.input_ids:
            # No examples on this rank: a one-token forward with weight 0, so every parameter still gets a
            # (zero) gradient and the step issues the same collectives as everywhere else.
            dummy = torch.zeros(1, 1, dtype=torch.int64, device=self.head.weight.device)
            return total + 0.0 * self._logits(self.embed(dummy)).sum()
        pieces = {p: torch.split(media[p], batch.media_counts[p]) for p in self.PHASES}
        for e, (ids, labels) in enumerate(zip(batch.input_ids, batch.labels)):
            if ids.numel() > c.max_len:
                raise ValueError(f"example {batch.example_ids[e]}: {ids.numel()} tokens exceed max_len={c.max_len}")
            x = self.embed(ids)
            for p, token in zip(self.PHASES, (c.image_token_id, c.audio_token_id)):
                mask = ids == token
                rows = pieces[p][e]
                if int(mask.sum()) != rows.shape[0]:
                    raise ValueError(f"example {batch.example_ids[e]}: {int(mask.sum())} {p} placeholder tokens "
                                     f"but {rows.shape[0]} {p} rows; each item needs rows // downsample placeholders")
                x = x.masked_scatter(mask[:, None], rows.to(x.dtype))
            logits = self._logits(x[None])[0]
            total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        return total

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos(torch.arange(x.shape[1], device=x.device))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def orchestrator_config(config: TinyMLLMConfig = TinyMLLMConfig(), *, ranks_per_node: int | None = None,
                        balance: bool = True, vision_cost: QuadraticCost = QuadraticCost(),
                        audio_cost: QuadraticCost = QuadraticCost(),
                        llm_cost: QuadraticCost = QuadraticCost(), balance_encoders: bool = True) -> OrchestratorConfig:
    """An [`OrchestratorConfig`][OrchestratorConfig] matching the model's phases (costs default to rows / tokens).

    Costs must be equal on every rank: fit them once
    ([`evenflow.balance.costs.fit_quadratic()`][evenflow.balance.costs.fit_quadratic]) and pass the same numbers
    everywhere, never per-rank timings. ``balance_encoders=False`` balances the LLM phase only (each media item is
    encoded on the rank that sampled its example).
    """
    return OrchestratorConfig(
        encoders={"vision": PhaseSpec(cost=vision_cost, input_dim=config.patch_dim, downsample=config.patch_merge,
                                      balanced=balance_encoders),
                  "audio": PhaseSpec(cost=audio_cost, input_dim=config.n_mels, downsample=config.frame_stride,
                                     balanced=balance_encoders)},
        llm=PhaseSpec(cost=llm_cost), ranks_per_node=ranks_per_node, balance=balance)


def make_examples(generator: torch.Generator, count: int, config: TinyMLLMConfig = TinyMLLMConfig(), *,
                  max_text: int = 24, max_images: int = 2, max_patches: int = 16, max_audio: int = 1,
                  max_frames: int = 32, dtype: torch.dtype = torch.float64) -> list[ExampleInputs]:
    """Random examples: text with image/audio placeholders; the first token of each item's span is unsupervised.

    Counts are drawn uniformly in ``[0, max_*]`` (text at least 2 tokens), so some examples have no images
    or no audio. Deterministic given ``generator``.
    """
    if {config.image_token_id, config.audio_token_id} - {0, 1, 2}:
        raise ValueError("make_examples draws text tokens from 3..vocab_size-1: use image_token_id and "
                         "audio_token_id in {0, 1, 2}")

    def draw(high: int, low: int = 0) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    out = []
    for _ in range(count):
        pieces: list[torch.Tensor] = []
        supervised: list[torch.Tensor] = []
        media: dict[str, list[torch.Tensor]] = {"vision": [], "audio": []}
        for phase, k, max_rows, unit, dim, token in (
                ("vision", draw(max_images), max_patches, config.patch_merge, config.patch_dim, config.image_token_id),
                ("audio", draw(max_audio), max_frames, config.frame_stride, config.n_mels, config.audio_token_id)):
            for _ in range(k):
                rows = unit * draw(max(1, max_rows // unit), 1)
                media[phase].append(torch.randn(rows, dim, generator=generator, dtype=dtype))
                pieces.append(torch.full((rows // unit,), token, dtype=torch.int64))
                supervised.append(torch.zeros(rows // unit, dtype=torch.bool))
        n_text = draw(max_text, 2)
        pieces.append(torch.randint(3, config.vocab_size, (n_text,), generator=generator))
        supervised.append(torch.ones(n_text, dtype=torch.bool))
        ids = torch.cat(pieces)
        labels = torch.where(torch.cat(supervised), ids, torch.full_like(ids, IGNORE_INDEX))
        out.append(ExampleInputs(input_ids=ids, labels=labels, media=media))
    return out
