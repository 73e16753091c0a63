"""What the demo trains on, with which model, which arms, and the LR schedule. Frozen; checked on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..lr import LRScaling

__all__ = ["ARMS", "REFERENCE", "LR_RULE_ARMS", "DemoConfig", "arm_lr_scaling", "quick_config", "schedule_factor"]

ARMS = ("hf_default", "group_by_length", "trl_packing", "evenflow", "evenflow_summed")
"""What a user decides between (evenflow.demo.steps and evenflow.demo.arms say how each batches): HF ``Trainer``'s
default random padded batches (the reference), its ``group_by_length``, TRL's packing, evenflow's defaults and
evenflow with ``cost="summed"``."""
REFERENCE = "hf_default"
"""The arm every other is compared with: held-out loss, throughput and time to its final loss."""
LR_RULE_ARMS = ("evenflow", "evenflow_summed")
"""The arms that train under ``DemoConfig.lr_scaling``; every other arm uses the plain schedule."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run: every arm trains one epoch over the same samples, in interleaved timed chunks.

    The defaults are the setting of ``benchmarks/quality_replay.py`` (which holds out 256 chats instead of 48):
    the verdict quotes the replay's intervals only when the fields that change what trains are these
    ([`evenflow.demo.replay.same_setting()`][evenflow.demo.replay.same_setting])."""

    train_samples: int = 1000
    """Chitchat conversations trained on (a seeded random subset of those with a reply)."""
    heldout_samples: int = 48
    """Other conversations, never trained on, for the per-token loss after every chunk."""
    cutoff: int = 4096
    """Truncation length of the chat pipeline (tokens)."""
    token_budget: int = 4096
    """Padded tokens per batch per rank (the memory model) -- for every arm."""
    world_size: int = 2
    """gloo ranks (spawned processes, one CPU thread each)."""
    vocab_size: int = 4096
    """Dense vocabulary after the remap (the most frequent ids + unk; lengths stay real). See evenflow.data.vocab."""
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    base_lr: float = 3e-3
    """Peak LR (after warm-up) of an optimizer step holding ``reference_tokens`` supervised tokens."""
    reference_tokens: int | None = None
    """Reference of the token LR rule (evenflow.lr). ``None``: the mean global supervised tokens per optimizer
    step of the planner-only dry run -- the same value for every arm, so at the mean step every arm gets
    ``base_lr``."""
    lr_scaling: LRScaling = "none"
    """Token LR rule of the variable-batch arms ``evenflow`` and ``evenflow_summed``. ``"none"``, as the library
    (the rule is opt-in): the replay measured that the sqrt rule costs 0.020 [0.002, 0.038] nats/token with the
    alternating default on chitchat (16 seeds, docs/default-trains.md). The HF and TRL arms train without it, as
    their users do. With a rule, the replay's intervals are for another setting and the verdict says so."""
    buffer_size: int | None = None
    """The evenflow arms' ``DynamicBatchLoader(buffer_size=)``, per rank; ``None``: the library's default (4,096),
    which the demo uses since the default plans mixed, unordered steps (the demo pinned 128 before,
    when a buffer holding a whole shard made steps length-homogeneous and ordered like a curriculum)."""
    warmup_fraction: float = 0.05
    """Linear warm-up over this fraction of each arm's optimizer steps, then cosine decay."""
    final_lr_fraction: float = 0.1
    """The cosine decays to ``base_lr * final_lr_fraction`` at the arm's last optimizer step."""
    max_grad_norm: float = 1.0
    seed: int = 0
    num_workers: int = 1
    """DataLoader workers per rank, in every arm."""
    rounds: int = 8
    """Timed rounds: each arm's epoch is cut into this many chunks, run in ABBA order (A B C, C B A, ...)."""
    arms: tuple[str, ...] = ARMS
    timeout_s: float = 300.0
    """Bound on rendezvous and every collective: a stuck rank fails the demo instead of hanging it."""

    def __post_init__(self) -> None:
        positive = ("train_samples", "heldout_samples", "cutoff", "token_budget", "world_size", "vocab_size",
                    "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "rounds")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.token_budget < self.cutoff:
            raise ValueError(f"token_budget={self.token_budget} is below cutoff={self.cutoff}: a sample at the "
                             "cutoff would not fit in any batch; raise the budget or lower the cutoff")
        if self.buffer_size is not None and (isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int)
                                             or self.buffer_size <= 0):
            raise ValueError(f"buffer_size must be a positive integer or None, got {self.buffer_size!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                             f"and num_heads by num_kv_heads ({self.num_kv_heads})")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2 (unk + one token)")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"base_lr must be a positive number, got {self.base_lr!r}")
        if self.reference_tokens is not None and (not isinstance(self.reference_tokens, int)
                                                  or self.reference_tokens <= 0):
            raise ValueError(f"reference_tokens must be a positive integer or None, got {self.reference_tokens!r}")
        if not (0 <= self.warmup_fraction < 1 and 0 < self.final_lr_fraction <= 1):
            raise ValueError("warmup_fraction must lie in [0, 1) and final_lr_fraction in (0, 1]")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or REFERENCE not in self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {ARMS} and include {REFERENCE!r} (the reference), "
                             f"got {self.arms!r}")
        if self.num_workers < 0 or self.timeout_s <= 0:
            raise ValueError("num_workers must be >= 0 and timeout_s > 0")


def quick_config(config: DemoConfig | None = None) -> DemoConfig:
    """A seconds-long variant for tests: 96 chats, cutoff 512, budget 1024 (HF batch size 2), 5 rounds, every arm."""
    return replace(config or DemoConfig(), train_samples=96, heldout_samples=8, cutoff=512, token_budget=1024,
                   vocab_size=2048, hidden_size=32, intermediate_size=64, num_layers=1, rounds=5, arms=ARMS)


def arm_lr_scaling(arm: str, config: DemoConfig) -> LRScaling:
    """The token LR rule ``arm`` trains under (evenflow.TokenLRScaler)."""
    return config.lr_scaling if arm in LR_RULE_ARMS else "none"


def schedule_factor(step: int, total_steps: int, config: DemoConfig) -> float:
    """The LR schedule in optimizer steps, the same shape for every arm: linear warm-up, then cosine.

    ``step`` counts optimizer steps taken so far (0 = the first). With 100 steps, warm-up 0.05 and final 0.1:
    step 0 -> 0.2, step 4 -> 1.0, step 99 -> 0.1.
    """
    warmup = max(1, round(config.warmup_fraction * total_steps)) if config.warmup_fraction else 0
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total_steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    low = config.final_lr_fraction
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
