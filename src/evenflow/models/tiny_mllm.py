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
from ..balance.orchestrator import ExampleInputs, LLMInputs, OrchestratorConfig, PhaseSpec

__all__ = ["TinyMLLMConfig", "TinyMLLM", "make_examples", "orchestrator_config"]

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
        if min(self.image_token_id, self.audio_token_id) < 0 or max(self.image_token_id, self.audio_token_id) >= 3:
            raise ValueError("image_token_id and audio_token_id must be in {0, 1, 2} (0 is padding) -- "
                             "make_examples draws text tokens from 3..vocab_size-1")


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
        """Phase name -> encoder, for :meth:`GlobalOrchestrator.step` and :func:`local_step`."""
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
                        llm_cost: QuadraticCost = QuadraticCost()) -> OrchestratorConfig:
    """An :class:`OrchestratorConfig` matching the model's phases (costs default to rows / tokens).

    Costs must be equal on every rank: fit them once (:func:`evenflow.balance.costs.fit_quadratic`) and
    pass the same numbers everywhere, never per-rank timings.
    """
    return OrchestratorConfig(
        encoders={"vision": PhaseSpec(cost=vision_cost, input_dim=config.patch_dim, downsample=config.patch_merge),
                  "audio": PhaseSpec(cost=audio_cost, input_dim=config.n_mels, downsample=config.frame_stride)},
        llm=PhaseSpec(cost=llm_cost), ranks_per_node=ranks_per_node, balance=balance)


def make_examples(generator: torch.Generator, count: int, config: TinyMLLMConfig = TinyMLLMConfig(), *,
                  max_text: int = 24, max_images: int = 2, max_patches: int = 16, max_audio: int = 1,
                  max_frames: int = 32, dtype: torch.dtype = torch.float64) -> list[ExampleInputs]:
    """Random examples: text with image/audio placeholders; the first token of each item's span is unsupervised.

    Counts are drawn uniformly in ``[0, max_*]`` (text at least 2 tokens), so some examples have no images
    or no audio. Deterministic given ``generator``.
    """
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
