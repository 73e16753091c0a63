"""Where the cost coefficients come from: a fit to measured timings, or published GPU FLOP rates.

* [`fit_phase()`][fit_phase] -- least squares (non-negative) of ``t = per_batch + b * (gamma + alpha L + beta L^2)``
  over measured (batch size b, padded length L, seconds) triples.
* [`measure_cpu()`][measure_cpu] -- time forward + backward of a tiny random-init causal LM (``transformers``
  ``Qwen3Config``, no weights downloaded) on a grid of padded shapes; [`cpu_cost_model()`][cpu_cost_model] fits it.
* [`gpu_cost_model()`][gpu_cost_model] -- coefficients from FLOP counts and a datasheet peak times an assumed MFU.

NOTE [ GPU cost from FLOPs ]
    Training a decoder costs about 6 FLOPs per parameter per token for the dense matmuls (forward 2,
    backward 4; the LM head included) and, per sequence of length L and per layer, 2 * 2 * L^2 * d_attn
    forward FLOPs for the attention scores (QK^T and AV, d_attn = heads x head_dim), halved by a causal
    kernel that skips masked blocks, times 3 for forward + backward:

        alpha = 6 * N_matmul / R        beta = 6 * layers * d_attn / R        R = peak * MFU

    Qwen3-8B (config.json: 36 layers, hidden 4096, 32 query heads and 8 KV heads of 128, MLP 12288,
    vocab 151,936): N_matmul = 36 * (2 * 4096^2 + 2 * 4096 * 1024 + 3 * 4096 * 12288) + 151,936 * 4096
    = 7.57e9, so alpha ~ 4.5e10 / R per token and beta ~ 8.8e5 / R per squared token: attention matches the
    matmuls only at L ~ 51k tokens. Peaks (bf16 dense, no sparsity): H100 SXM 989 TFLOPS, H20 148 TFLOPS
    (NVIDIA datasheets; the ODB paper trains on 8 x H20). MFU 0.40 is an assumption (well-tuned dense
    training reaches 0.35-0.45; OrchMLLM reports 41.6 % on 2,560 H100s).

    ``step_overhead`` (0.09 s on H100, assumed): ZeRO-2 reduce-scatters gradients and all-gathers updated
    parameters each step, 2 x 16.4 GB x 7/8 over NVLink at ~360 GB/s bus bandwidth ~ 0.08 s, plus ~0.01 s
    of Adam on a 1/8 shard. ``per_batch`` (0.01 s, assumed) covers kernel launches for a micro-batch.
    A linear-in-tokens model ignores the lower MFU of very small batches, so it *understates* the cost of
    small fixed batches (the Standard baseline) -- speedups computed with it are conservative.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .costs import CostModel, PhaseCost

__all__ = ["Timing", "fit_phase", "measure_cpu", "cpu_cost_model", "GPU_PEAK_TFLOPS", "ModelShape", "QWEN3_8B",
           "gpu_cost_model", "TINY_QWEN3"]

GPU_PEAK_TFLOPS = {"H100": 989.0, "H20": 148.0, "A100": 312.0}
"""bf16 dense tensor-core peaks from NVIDIA datasheets (TFLOPS, without structured sparsity)."""


@dataclass(frozen=True)
class Timing:
    """One measured shape: ``batch`` rows padded to ``length`` tokens took ``seconds``."""

    batch: int
    length: int
    seconds: float


def fit_phase(timings: Sequence[Timing], *, name: str = "llm", length_key: str = "tokens",
              fit_per_batch: bool = True) -> tuple[PhaseCost, dict]:
    """Fit ``seconds = per_batch + b * (per_sample + per_token * L + per_token_sq * L^2)`` (all >= 0).

    Relative least squares (each timing weighted by 1 / seconds), so small shapes count as much as large
    ones. Returns the phase and fit diagnostics (``max_rel_err``, ``mean_rel_err``).

    >>> ts = [Timing(b, l, 0.01 + b * (1e-4 + 2e-6 * l + 3e-9 * l * l)) for b in (1, 4) for l in (64, 512, 2048)]
    >>> p, diag = fit_phase(ts)
    >>> [round(v / t, 6) for v, t in zip((p.per_batch, p.per_sample, p.per_token, p.per_token_sq),
    ...                                  (0.01, 1e-4, 2e-6, 3e-9))]
    [1.0, 1.0, 1.0, 1.0]
    """
    from scipy.optimize import nnls

    if len(timings) < 4:
        raise ValueError(f"need at least 4 timings to fit 4 coefficients, got {len(timings)}")
    b = np.array([t.batch for t in timings], dtype=np.float64)
    ls = np.array([t.length for t in timings], dtype=np.float64)
    y = np.array([t.seconds for t in timings], dtype=np.float64)
    cols = [np.ones_like(b) if fit_per_batch else np.zeros_like(b), b, b * ls, b * ls * ls]
    a = np.stack(cols, axis=1)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / y
    coef, _ = nnls((a / scale) * w[:, None], y * w)
    coef = coef / scale
    pred = a @ coef
    rel = np.abs(pred - y) / y
    phase = PhaseCost(name=name, length_key=length_key, per_batch=float(coef[0]), per_sample=float(coef[1]),
                      per_token=float(coef[2]), per_token_sq=float(coef[3]))
    return phase, {"max_rel_err": float(rel.max()), "mean_rel_err": float(rel.mean()), "points": len(timings)}


TINY_QWEN3 = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                  tie_word_embeddings=True)
"""The tiny causal LM used for CPU calibration and the real CPU runs (random init, ~1.2M parameters)."""


def measure_cpu(shapes: Sequence[tuple[int, int]], *, config: dict | None = None, repeats: int = 3,
                threads: int | None = 1, seed: int = 0) -> list[Timing]:
    """Seconds of forward + backward of a tiny random-init Qwen3 for each (batch, length) shape: the minimum
    over ``repeats`` runs after a warm-up (on a shared machine other processes only ever add time).

    ``threads`` pins ``torch.set_num_threads`` for the measurement (restored after). Needs ``transformers``.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        cfg = Qwen3Config(**{**TINY_QWEN3, **(config or {})})
        cfg._attn_implementation = "sdpa"
        model = Qwen3ForCausalLM(cfg)
        model.train()
        gen = torch.Generator().manual_seed(seed)
        out = []
        for batch, length in shapes:
            ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=gen)
            times = []
            for rep in range(repeats + 1):  # the first run warms up allocator and kernels
                t0 = time.perf_counter()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                dt = time.perf_counter() - t0
                model.zero_grad(set_to_none=True)
                if rep:
                    times.append(dt)
            out.append(Timing(batch, length, float(np.min(times))))
        return out
    finally:
        torch.set_num_threads(prev_threads)


DEFAULT_CPU_SHAPES = tuple((b, l) for b in (1, 2, 4, 8) for l in (32, 64, 128, 256, 512) if b * l <= 2048) + \
    ((1, 1024), (2, 1024), (1, 2048))


def cpu_cost_model(shapes: Sequence[tuple[int, int]] = DEFAULT_CPU_SHAPES, *, repeats: int = 3,
                   threads: int | None = 1, step_overhead: float | None = None) -> CostModel:
    """Measure [`TINY_QWEN3`][TINY_QWEN3] on this CPU and fit one ``"llm"`` phase.

    ``step_overhead`` defaults to the measured time of an AdamW step on the tiny model's parameters.
    """
    timings = measure_cpu(shapes, repeats=repeats, threads=threads)
    phase, diag = fit_phase(timings)
    if step_overhead is None:
        step_overhead = _measure_optimizer_step(threads)
    return CostModel(phases=(phase,), step_overhead=step_overhead,
                     source=f"fit to {len(timings)} measured CPU fwd+bwd timings of a tiny random-init Qwen3 "
                            f"({threads} thread(s)); max rel. error {diag['max_rel_err']:.1%}",
                     meta={"timings": [(t.batch, t.length, t.seconds) for t in timings], **diag})


def _measure_optimizer_step(threads: int | None) -> float:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        return float(np.min(times[1:]))
    finally:
        torch.set_num_threads(prev)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the FLOP count needs from a decoder's config.json."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def matmul_params(self) -> float:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return float(self.layers * (q_o + k_v + mlp) + self.vocab * self.hidden)


QWEN3_8B = ModelShape(name="Qwen3-8B", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                      intermediate=12288, vocab=151936)


def gpu_cost_model(gpu: str = "H100", *, mfu: float = 0.40, model: ModelShape = QWEN3_8B,
                   step_overhead: float = 0.09, per_batch: float = 0.01) -> CostModel:
    """Coefficients from FLOPs (NOTE [ GPU cost from FLOPs ]). ``gpu`` is a key of
    [`GPU_PEAK_TFLOPS`][GPU_PEAK_TFLOPS]."""
    if gpu not in GPU_PEAK_TFLOPS:
        raise KeyError(f"unknown GPU {gpu!r}; known: {sorted(GPU_PEAK_TFLOPS)}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    rate = GPU_PEAK_TFLOPS[gpu] * 1e12 * mfu
    alpha = 6 * model.matmul_params / rate
    beta = 6 * model.layers * model.heads * model.head_dim / rate
    phase = PhaseCost(name="llm", per_batch=per_batch, per_token=alpha, per_token_sq=beta)
    return CostModel(phases=(phase,), step_overhead=step_overhead,
                     source=f"{model.name} FLOPs on {gpu} ({GPU_PEAK_TFLOPS[gpu]:.0f} TFLOPS bf16 dense peak, "
                            f"datasheet) x MFU {mfu:.2f} (assumed); step overhead {step_overhead} s, per batch "
                            f"{per_batch} s (assumed)",
                     meta={"gpu": gpu, "mfu": mfu, "peak_tflops": GPU_PEAK_TFLOPS[gpu],
                           "matmul_params": model.matmul_params, "alpha": alpha, "beta": beta})
