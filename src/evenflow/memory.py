"""A first-principles training-memory model: how many tokens fit in one batch for a decoder and a memory limit.

    shape = ModelShape.from_hf_config(config, dtype="bfloat16", activation_checkpointing=True)
    rec = recommend_token_budget(shape, memory_bytes=80 * 2**30)
    rec.token_budget, rec.breakdown()

Nothing here is fitted to a measurement: every term is a count of the tensors PyTorch keeps for one training
step of a Llama/Qwen-style decoder (RMSNorm, rotary, grouped-query attention through SDPA, SwiGLU MLP, untied
or tied LM head, HF's float32 cross-entropy), times their element size. tests/test_budget.py checks it against
the peak RSS of real forward+backward passes in fresh subprocesses (CPU) and states the error.

NOTE [ Memory model ]
    static  = P x (w + g + o): weights and gradients in the parameter dtype (w = g bytes), optimizer state o
              (AdamW: two float32 moments = 8 bytes/parameter; SGD with momentum: 4; plain SGD: 0).
    per token, per layer, kept for backward (elements; h hidden, q = heads x head_dim, k = kv_heads x head_dim,
    I intermediate):
        2 RMSNorms            4h      each keeps its input and its normalized output (h + h)
        q/k/v (+ rotary)      q + 2k  the attention inputs (rotary keeps only cos/sin, shared by all layers)
        q_norm/k_norm (Qwen3) 2q + 2k their inputs and outputs, when the model has them
        attention output      2q      SDPA's output and the o_proj input (its transposed contiguous copy)
        SwiGLU MLP            4I      gate, silu(gate), up, silu(gate) * up
      with activation checkpointing only each layer's input (h) is kept, plus one layer's full set during
      its recomputation.
    per token, once: the logits. The LM head writes them in the parameter dtype; HF's loss upcasts them to
    float32 and log_softmax keeps its float32 output (the LM head's own output is kept by nothing once the
    loss is formed -- unless the caller holds ``outputs.logits``). The peak is log_softmax's backward: its saved
    output, the incoming gradient and the outgoing gradient, all float32: 3 x 4 x V bytes per token.
    optimizer step: AdamW (torch's default foreach implementation) builds its denominator sqrt(v) + eps as a
    parameter-sized float32 temporary: + 4 x P bytes while stepping (activations are freed by then), so the
    peak is static + max(activations + logits, 4 P).
    Eager attention would add heads x L float32 scores per token (L = row length); SDPA/flash keep none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

__all__ = ["ModelShape", "MemoryEstimate", "BudgetRecommendation", "estimate_memory", "recommend_token_budget",
           "DTYPE_BYTES", "OPTIMIZER_STATE_BYTES"]

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd_momentum": 4, "sgd": 0}
"""Bytes of optimizer state per parameter (float32 moments, as torch.optim keeps them for float32 params)."""
_FP32 = 4

Optimizer = Literal["adamw", "sgd_momentum", "sgd"]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the memory model needs to know about a decoder-only transformer."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    dtype: str = "float32"
    """Parameter and activation dtype (mixed precision with float32 master weights is not modelled)."""
    activation_checkpointing: bool = False
    num_params: int | None = None
    """Total parameters; ``None`` counts them from the shape."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"ModelShape.dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def from_hf_config(cls, config: object, *, dtype: str = "float32", activation_checkpointing: bool = False,
                       num_params: int | None = None) -> ModelShape:
        """From a transformers config object or its ``config.json`` dict (Llama, Qwen2/3, Mistral shapes)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        model_type = get("model_type", "") or ""
        return cls(hidden_size=hidden, num_layers=get("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim") or hidden // heads,
                   intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                   tie_word_embeddings=bool(get("tie_word_embeddings", False)), qk_norm=model_type.startswith("qwen3"),
                   dtype=dtype, activation_checkpointing=activation_checkpointing, num_params=num_params)

    def parameters(self) -> int:
        if self.num_params is not None:
            return self.num_params
        h, q, k = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * k + q * h + (2 * self.head_dim if self.qk_norm else 0)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step at ``tokens`` tokens per batch (see NOTE [ Memory model ])."""

    tokens: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    step_transient: int = 0
    """Optimizer-step temporaries (NOTE [ Memory model ]); they coexist with the static memory only."""

    @property
    def static(self) -> int:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """Peak of the step: static memory plus the larger of backward's and the optimizer step's extras."""
        return self.static + max(self.activations + self.logits, self.step_transient)

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "static": self.static, "total": self.total}


def _layer_elements(shape: ModelShape) -> int:
    """Elements one layer keeps per token for backward (NOTE [ Memory model ])."""
    h, q, k = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    norms = 4 * h
    attention_in = q + 2 * k
    qk_norm = 2 * q + 2 * k if shape.qk_norm else 0
    attention_out = 2 * q
    mlp = 4 * shape.intermediate_size
    return norms + attention_in + qk_norm + attention_out + mlp


def activation_bytes_per_token(shape: ModelShape) -> tuple[int, int]:
    """(layer activations, logits) bytes per token, at the peak of one step."""
    b = DTYPE_BYTES[shape.dtype]
    per_layer = _layer_elements(shape) * b
    if shape.activation_checkpointing:
        layers = shape.num_layers * shape.hidden_size * b + per_layer
    else:
        layers = shape.num_layers * per_layer + shape.hidden_size * b  # + the final norm's output
    # Logits: log_softmax's saved float32 output + incoming and outgoing float32 gradients at its backward.
    logits = shape.vocab_size * 3 * _FP32
    return layers, logits


def estimate_memory(shape: ModelShape, tokens: int, *, optimizer: Optimizer = "adamw") -> MemoryEstimate:
    """Peak bytes of one forward+backward+step at ``tokens`` tokens (padded tokens for padded batches)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    b = DTYPE_BYTES[shape.dtype]
    params = shape.parameters()
    layers, logits = activation_bytes_per_token(shape)
    return MemoryEstimate(tokens=tokens, weights=params * b, gradients=params * b,
                          optimizer=params * OPTIMIZER_STATE_BYTES[optimizer], activations=tokens * layers,
                          logits=tokens * logits, step_transient=params * _FP32 if optimizer == "adamw" else 0)


@dataclass(frozen=True)
class BudgetRecommendation:
    token_budget: int
    """Largest token count whose estimated peak fits ``memory_bytes x (1 - headroom)``, rounded down to
    ``multiple_of``."""
    memory_bytes: int
    headroom: float
    estimate: MemoryEstimate
    bytes_per_token: int

    def as_dict(self) -> dict[str, object]:
        return {"token_budget": self.token_budget, "memory_bytes": self.memory_bytes, "headroom": self.headroom,
                "bytes_per_token": self.bytes_per_token, "estimate": self.estimate.as_dict()}


def recommend_token_budget(shape: ModelShape, memory_bytes: int, *, optimizer: Optimizer = "adamw",
                           headroom: float = 0.1, multiple_of: int = 64) -> BudgetRecommendation:
    """The ``token_budget`` for one rank with ``memory_bytes`` of device memory.

    ``headroom`` keeps a fraction free for the allocator's fragmentation, framework buffers and kernels'
    workspaces (not modelled). Raises when the static memory alone does not fit.

    >>> s = ModelShape(hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=8, head_dim=64,
    ...                intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, qk_norm=True,
    ...                dtype="bfloat16")
    >>> r = recommend_token_budget(s, 24 * 2**30)
    >>> r.token_budget, round(r.estimate.static / 2**30, 2)
    (5952, 5.11)
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    usable = int(memory_bytes * (1 - headroom))
    empty = estimate_memory(shape, 0, optimizer=optimizer)
    static = empty.static
    layers, logits = activation_bytes_per_token(shape)
    per_token = layers + logits
    if empty.total >= usable:
        raise ValueError(f"the model's weights, gradients and {optimizer} state need {static / 2**30:.2f} GiB, more "
                         f"than the {usable / 2**30:.2f} GiB usable of {memory_bytes / 2**30:.2f} GiB: use a smaller "
                         "model, sharding (FSDP), or an optimizer with less state")
    tokens = (usable - static) // per_token
    tokens = tokens // multiple_of * multiple_of if tokens >= multiple_of else tokens
    return BudgetRecommendation(token_budget=int(tokens), memory_bytes=int(memory_bytes), headroom=headroom,
                                estimate=estimate_memory(shape, int(tokens), optimizer=optimizer),
                                bytes_per_token=int(per_token))
