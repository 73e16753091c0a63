"""What the demo trains on, with which model, and the learning-rate rule. Frozen; checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["DemoConfig", "quick_config", "lr_for_step"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run: a fixed-batch epoch and an evenflow epoch over the same samples."""

    train_samples: int = 1000
    """Chitchat conversations trained on (a seeded random subset of those with a reply)."""
    heldout_samples: int = 48
    """Other conversations, never trained on, for the per-token loss after each epoch."""
    cutoff: int = 4096
    """Truncation length of the chat pipeline (tokens)."""
    token_budget: int = 4096
    """Padded tokens per batch per rank (the memory model) -- for both runs."""
    world_size: int = 2
    """gloo ranks (spawned processes, one CPU thread each)."""
    vocab_size: int = 4096
    """Dense vocabulary after the remap (the most frequent ids + unk; lengths stay real). See evenflow.data.vocab."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    base_lr: float = 1.5e-3
    """Learning rate of a step holding ``reference_tokens`` supervised tokens (see :func:`lr_for_step`)."""
    reference_tokens: int = 1024
    max_grad_norm: float = 1.0
    seed: int = 0
    num_workers: int = 1
    """DataLoader workers per rank, in both runs."""
    timeout_s: float = 300.0
    """Bound on rendezvous and every collective: a stuck rank fails the demo instead of hanging it."""

    def __post_init__(self) -> None:
        positive = ("train_samples", "heldout_samples", "cutoff", "token_budget", "world_size", "vocab_size",
                    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "reference_tokens")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.token_budget < self.cutoff:
            raise ValueError(f"token_budget={self.token_budget} is below cutoff={self.cutoff}: a sample at the "
                             "cutoff would not fit in any batch; raise the budget or lower the cutoff")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2 (unk + one token)")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"base_lr must be a positive number, got {self.base_lr!r}")
        if self.num_workers < 0 or self.timeout_s <= 0:
            raise ValueError("num_workers must be >= 0 and timeout_s > 0")


def quick_config(config: DemoConfig | None = None) -> DemoConfig:
    """A seconds-long variant for tests: 96 chats, cutoff 512, budget 1024 (fixed batch size 2)."""
    return replace(config or DemoConfig(), train_samples=96, heldout_samples=8, cutoff=512, token_budget=1024,
                   vocab_size=2048, hidden_size=32, intermediate_size=64, num_layers=1)


def lr_for_step(config: DemoConfig, step_tokens: int) -> float:
    """Square-root scaling (the Adam rule): ``base_lr * sqrt(step_tokens / reference_tokens)``.

    ``step_tokens`` is the step's global supervised-token count, so a step with 4x the tokens takes a 2x
    larger step. Both runs use this same rule; a step with no supervised token gets 0. Example with the
    defaults: 4,096 tokens -> 3e-3, 256 tokens -> 7.5e-4.
    """
    return config.base_lr * math.sqrt(max(step_tokens, 0) / config.reference_tokens)
