"""The one prepared GPU check: run it once when a device is lent (<= 5 min on one GPU with --budget-s 300).

    python benchmarks/gpu_check.py --budget-s 300 --out gpu_check.jsonl     # on the GPU machine
    python benchmarks/gpu_check.py --cpu-reduced --budget-s 60              # what the test suite runs

Appends one JSON line per section to ``--out`` (and stdout) as soon as the section ends, so a run cut short
still leaves what it measured; the LAST line is ``{"section": "summary", ...}``. Sections:

1. ``env`` -- torch / CUDA versions, device names and count.
2. ``llm_step`` -- bf16 forward+backward step times of a Qwen3-0.6B-shaped model (random init, 28 layers,
   hidden 1024, GQA 16/8 heads, vocabulary 151,936; SDPA attention) over (batch, length) shapes, then a fit of
   the simulator's padded cost ``per_batch + b * (per_sample + per_token L + per_token_sq L^2)``
   (:class:`evenflow.sim.costs.PhaseCost` fields) and of the orchestrator's per-sequence
   :class:`~evenflow.balance.QuadraticCost`, with the fit's relative error per shape.
3. ``loader`` -- ``DynamicBatchLoader`` throughput with ``pin_memory=True`` and ``non_blocking`` copies on a
   side stream, overlapped with a compute step: loader alone, compute alone, both (overlap efficiency =
   compute time / overlapped time; 1.0 = the copies and the input pipeline are fully hidden).
4. ``orchestrator`` -- the multi-phase orchestrator (tiny MLLM, fp32) and the balancing all-to-all on CUDA
   tensors over NCCL, one process per GPU. With one GPU the all-to-all is a local copy (``"a2a_is_noop":
   true``): it checks the CUDA code path, not the interconnect. Checks the orchestrated loss equals the
   single-process one, and times plan, step and the raw all-to-all per size.
5. ``vlm_phases`` -- per-phase bf16 forward+backward times of a Qwen2.5-VL-7B-shaped model (random init: its
   vision tower on single frames of L patch rows, its text model on single examples of L tokens, through the
   balanced step's own adapter), each beside its training FLOPs (``evenflow.vlm.flops``: achieved
   TFLOP/s), and the per-phase quadratic the planners take (``VLMConfig.time_cost``) fitted to them -- the
   cost model of a real GPU.
6. ``flash_attn`` -- packed (padding-free) FlashAttention-2 against sdpa on the same Qwen2.5-VL-shaped text
   model and the same packed row (position ids ``[4, 1, N]``, no attention mask): logits and every gradient,
   and both against each example run alone. Skipped (not failed) where ``flash_attn`` is not installed.

``--cpu-reduced`` runs the same code on CPU (gloo, fp32, a 2-layer model, 2 ranks, small shapes, a tiny
Qwen2.5-VL) so that the suite keeps it from rotting; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                 tie_word_embeddings=True, rms_norm_eps=1e-6)
"""Qwen3-0.6B's published config.json shape (no weights are loaded: random init)."""
TINY_QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=1024,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
GPU_SHAPES = [(1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384), (2, 2048), (4, 1024), (8, 512),
              (16, 256), (4, 4096), (2, 8192)]
CPU_SHAPES = [(1, 32), (1, 64), (1, 128), (2, 64), (4, 32)]
# Share of the total budget each section may use before it stops starting new measurements.
SECTION_SHARE = {"llm_step": 0.3, "loader": 0.15, "orchestrator": 0.2, "vlm_phases": 0.25, "flash_attn": 0.1}
VLM_SIZES = {"gpu": {"vision": (1024, 2304, 4096, 9216, 16384), "llm": (1024, 2048, 4096, 8192, 16384)},
             "cpu": {"vision": (16, 64, 144, 256), "llm": (32, 64, 128, 256)}}
"""Patch rows of one frame (square grids: 32^2 ... 128^2 patches, 0.2 to 3.2 MP) and tokens of one example."""
FLASH_LENGTHS = {"gpu": (1500, 700, 2900, 300), "cpu": (30, 14, 58, 6)}
"""The examples of the packed row in the flash-attention check (uneven on purpose)."""


@dataclass(frozen=True, kw_only=True)
class Mode:
    device: str
    dtype: torch.dtype
    backend: str
    model: dict
    shapes: list
    world: int
    reduced: bool


def resolve_mode(cpu_reduced: bool) -> Mode:
    if cpu_reduced or not torch.cuda.is_available():
        return Mode(device="cpu", dtype=torch.float32, backend="gloo", model=TINY_QWEN3, shapes=CPU_SHAPES, world=2,
                    reduced=True)
    return Mode(device="cuda", dtype=torch.bfloat16, backend="nccl", model=QWEN3_06B, shapes=GPU_SHAPES,
                world=min(torch.cuda.device_count(), 8), reduced=False)


class Emitter:
    """One JSON line per section, flushed at once (a cut-short run keeps what it measured)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.t0 = time.perf_counter()

    def __call__(self, section: str, **fields) -> dict:
        line = {"section": section, "elapsed_s": round(time.perf_counter() - self.t0, 2), **fields}
        text = json.dumps(line, default=_jsonable)
        print(text, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")
        return line


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- 1. env ----------------------------------------------------------------------------------------------------

def section_env(mode: Mode) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "mode": "cpu-reduced" if mode.reduced
            else "gpu", "cuda_available": torch.cuda.is_available(), "world": mode.world}
    if torch.cuda.is_available():
        info.update(cuda=torch.version.cuda, devices=[torch.cuda.get_device_name(i)
                                                      for i in range(torch.cuda.device_count())])
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as exc:  # noqa: BLE001 - informational only
            info["nccl"] = f"unknown ({type(exc).__name__})"
    return info


# -- 2. LLM step times and the cost fit ------------------------------------------------------------------------

def build_qwen3(mode: Mode):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**mode.model, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).to(device=mode.device, dtype=mode.dtype)
    return model


def time_step(model, batch: int, length: int, mode: Mode, repeats: int) -> float:
    """Median seconds of one forward+backward at ``[batch, length]`` (after one warm-up step)."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, length), device=mode.device)
    times = []
    for i in range(repeats + 1):
        _sync(mode.device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        _sync(mode.device)
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return float(np.median(times))


def fit_padded_cost(rows: list[dict]) -> dict:
    """Non-negative least squares on ``t = per_batch + b*(per_sample + per_token L + per_token_sq L^2)``."""
    from scipy.optimize import nnls

    b = np.array([r["batch"] for r in rows], dtype=np.float64)
    L = np.array([r["length"] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows], dtype=np.float64)
    # Scale columns so that NNLS is well conditioned; weight rows by 1/t so relative errors count equally.
    X = np.stack([np.ones_like(b), b, b * L, b * L * L], axis=1)
    scale = X.max(axis=0)
    coef, _ = nnls((X / scale) / t[:, None], np.ones_like(t))
    coef = coef / scale
    pred = X @ coef
    names = ("per_batch", "per_sample", "per_token", "per_token_sq")
    return {"phase_cost": dict(zip(names, coef.tolist())),
            "quadratic_cost": {"gamma": float(coef[1]), "alpha": float(coef[2]), "beta": float(coef[3])},
            "rel_err": [float(x) for x in (pred - t) / t]}


def section_llm_step(mode: Mode, deadline: float) -> dict:
    model = build_qwen3(mode)
    params = sum(p.numel() for p in model.parameters())
    rows, skipped = [], []
    for batch, length in mode.shapes:
        if time.perf_counter() > deadline:
            skipped.append([batch, length])
            continue
        try:
            seconds = time_step(model, batch, length, mode, repeats=1 if mode.reduced else 3)
        except torch.OutOfMemoryError:
            skipped.append([batch, length, "oom"])
            model.zero_grad(set_to_none=True)  # a step cut short may have left gradients behind
            torch.cuda.empty_cache()
            continue
        rows.append({"batch": batch, "length": length, "seconds": seconds,
                     "tokens_per_s": batch * length / seconds})
    peak = torch.cuda.max_memory_allocated() / 2**30 if mode.device == "cuda" else None
    fit = fit_padded_cost(rows) if len({r["length"] for r in rows}) >= 3 else None
    del model
    if mode.device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "dtype": str(mode.dtype), "shapes": rows, "skipped": skipped, "fit": fit,
            "peak_gib": peak}


# -- 3. loader throughput with pinned, non-blocking copies overlapped with compute -------------------------------

class _Tokens(torch.utils.data.Dataset):
    """Long-tail token sequences (log-normal lengths), cheap to make: the loader, not the data, is measured."""

    def __init__(self, n: int, vocab: int, max_len: int) -> None:
        rng = np.random.default_rng(0)
        self.lengths = np.clip(rng.lognormal(5.5, 0.9, n).astype(np.int64), 8, max_len)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (int(self.lengths[i]),), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class _PinnedCollate:
    """PadCollate, then page-locked copies -- on the loader's collation thread, so the pinning overlaps training
    (``pin_memory=True`` pins the workers' samples; the collated batch is a new tensor and needs its own)."""

    def __init__(self, pin: bool) -> None:
        import evenflow

        self.pin = pin
        self.collate = evenflow.PadCollate()

    def __call__(self, samples):
        batch = self.collate(samples)
        return {k: v.pin_memory() if self.pin and torch.is_tensor(v) else v for k, v in batch.items()}


def _device_batches(loader, mode: Mode):
    """Yield device batches, copying batch t+1 on a side stream while batch t computes (CUDA)."""
    import evenflow

    stream = torch.cuda.Stream() if mode.device == "cuda" else None

    def fetch(it):
        batch = next(it, None)
        if batch is None:
            return None
        evenflow.pop_step_info(batch)
        if stream is None:
            return batch
        with torch.cuda.stream(stream):
            return {k: v.to(mode.device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}

    it = iter(loader)
    nxt = fetch(it)
    while nxt is not None:
        cur = nxt
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
            for v in cur.values():
                v.record_stream(torch.cuda.current_stream())
        nxt = fetch(it)  # issued before the compute on `cur`, so the copy overlaps it
        yield cur


def section_loader(mode: Mode, deadline: float) -> dict:
    import evenflow

    n, budget = (128, 1024) if mode.reduced else (8192, 16384)
    dataset = _Tokens(n, 1024, budget)
    hidden = 64 if mode.reduced else 4096
    weight = torch.randn(hidden, hidden, device=mode.device, dtype=mode.dtype)

    def compute(batch) -> None:
        # A stand-in step whose time scales with the batch's tokens (the copy must hide behind it).
        tokens = batch["input_ids"].numel()
        x = torch.randn(min(tokens, 8192), hidden, device=mode.device, dtype=mode.dtype)
        for _ in range(2 if mode.reduced else 16):
            x = torch.tanh(x @ weight)

    pin = mode.device == "cuda"

    def loader():
        return evenflow.DynamicBatchLoader(dataset, token_budget=budget, num_workers=2, buffer_size=256,
                                           pin_memory=pin, collate_fn=_PinnedCollate(pin), persistent_workers=False)

    out = {}
    for arm in ("loader_only", "compute_only", "overlapped"):
        if time.perf_counter() > deadline:
            out[arm] = "skipped (budget)"
            continue
        ld = loader()
        batches = list(_device_batches(ld, mode)) if arm == "compute_only" else None
        _sync(mode.device)
        t0 = time.perf_counter()
        steps, tokens = 0, 0
        for batch in (batches if batches is not None else _device_batches(ld, mode)):
            if arm != "loader_only":
                compute(batch)
            steps += 1
            tokens += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        _sync(mode.device)
        seconds = time.perf_counter() - t0
        ld.close()
        out[arm] = {"seconds": seconds, "steps": steps, "real_tokens_per_s": tokens / seconds}
    if all(isinstance(out[a], dict) for a in out):
        out["overlap_efficiency"] = out["compute_only"]["seconds"] / out["overlapped"]["seconds"]
    out["pin_memory"] = mode.device == "cuda"
    return out


# -- 4. orchestrator + balancing all-to-all over NCCL --------------------------------------------------------------

def _orch_rank(rank: int, world: int, mode: Mode) -> dict:
    import torch.distributed as dist

    from evenflow.exchange.dispatch import all_to_all_rows
    from evenflow.exchange import GlobalOrchestrator, local_step
    from evenflow.testing import TinyMLLM, TinyMLLMConfig, make_examples, orchestrator_config

    device = torch.device(mode.device, rank) if mode.device == "cuda" else torch.device("cpu")
    if mode.device == "cuda":
        torch.cuda.set_device(device)
    cfg = TinyMLLMConfig(d_model=64 if mode.reduced else 512, n_layers=2 if mode.reduced else 4, max_len=2048)
    torch.manual_seed(0)
    model = TinyMLLM(cfg).to(device)
    group = dist.group.WORLD
    orch = GlobalOrchestrator(orchestrator_config(cfg), group=group)
    scale = 1 if mode.reduced else 8
    examples = [make_examples(torch.Generator().manual_seed(r + 1), 4 + 3 * r, cfg, max_text=64 * scale,
                              max_patches=32 * scale, max_frames=64 * scale, dtype=torch.float32)
                for r in range(world)]
    local = examples[rank]
    total = sum(ex.meta(orch.config).loss_tokens for exs in examples for ex in exs)
    ref = model.lm_loss_sum(local_step([e for exs in examples for e in exs], model.encoders(), orch.config,
                                       total_loss_tokens=total, device=device)) / total
    timings = {"plan_ms": [], "step_ms": []}
    loss = None
    for _ in range(3):
        _sync(mode.device)
        t0 = time.perf_counter()
        meta = orch.gather_metadata([ex.meta(orch.config) for ex in local], device=device)
        t1 = time.perf_counter()
        plan = orch.plan(meta)
        t2 = time.perf_counter()
        batch = orch.step(plan, local, model.encoders(), device=device)
        loss = model.lm_loss_sum(batch) / batch.total_loss_tokens
        loss.backward()
        _sync(mode.device)
        timings["plan_ms"].append(1e3 * (t2 - t1))
        timings["step_ms"].append(1e3 * (time.perf_counter() - t0))
        model.zero_grad(set_to_none=True)
    summed = loss.detach().clone()
    dist.all_reduce(summed, group=group)
    a2a = []
    for rows in ((1 << 10, 1 << 14, 1 << 17) if not mode.reduced else (256, 1024)):
        x = torch.randn(rows * world, 256, device=device)
        counts = [rows] * world
        all_to_all_rows(x, counts, counts, group=group)  # warm-up
        _sync(mode.device)
        t0 = time.perf_counter()
        for _ in range(5):
            all_to_all_rows(x, counts, counts, group=group)
        _sync(mode.device)
        sec = (time.perf_counter() - t0) / 5
        a2a.append({"rows_per_peer": rows, "bytes_per_rank": x.numel() * 4, "ms": 1e3 * sec,
                    "gb_per_s": x.numel() * 4 * (world - 1) / world / sec / 1e9 if world > 1 else None})
    return {"loss": float(summed), "ref_loss": float(ref.detach()), "plan_ms": float(np.median(timings["plan_ms"])),
            "step_ms": float(np.median(timings["step_ms"])), "a2a": a2a}


def _orch_child(rank: int, world: int, tmp: str, mode: Mode) -> None:
    import torch.distributed as dist

    out = os.path.join(tmp, f"rank{rank}.json")
    try:
        torch.set_num_threads(1)
        dist.init_process_group(mode.backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        try:
            result = {"ok": True, **_orch_rank(rank, world, mode)}
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)


def section_orchestrator(mode: Mode, deadline: float) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        procs = [ctx.Process(target=_orch_child, args=(r, mode.world, tmp, mode)) for r in range(mode.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(5.0, deadline - time.perf_counter()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        ranks = []
        for r in range(mode.world):
            path = Path(tmp, f"rank{r}.json")
            ranks.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no result"})
    ok = all(r["ok"] for r in ranks)
    out = {"world": mode.world, "backend": mode.backend, "a2a_is_noop": mode.world == 1, "ranks": ranks}
    if ok:
        r0 = ranks[0]
        out["loss_rel_err"] = abs(r0["loss"] - r0["ref_loss"]) / abs(r0["ref_loss"])
        if mode.world == 1:
            out["note"] = ("one GPU: the all-to-all is a local copy; this checks the CUDA/NCCL code path, not the "
                           "interconnect. Re-run on a multi-GPU machine for exchange bandwidth.")
    return out


# -- 5. per-phase times of a Qwen2.5-VL-7B-shaped model --------------------------------------------------------

def build_qwen2_5_vl(mode: Mode):
    """Qwen2.5-VL-7B's shape on a GPU (``evenflow.vlm.flops.QWEN2_5_VL_7B``), a tiny one on CPU; random
    init, built in ``mode.dtype`` on ``mode.device`` (never a full-precision copy of 8 B parameters)."""
    import transformers

    from evenflow.vlm.flops import QWEN2_5_VL_7B

    if mode.reduced:
        vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, window_size=56,
                      fullatt_block_indexes=[1])
        text = dict(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    else:
        vision = dict(QWEN2_5_VL_7B["vision"])
        text = {k: v for k, v in QWEN2_5_VL_7B["text"].items() if k != "head_dim"}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [16, 24, 24] if not mode.reduced else [2, 1, 1],
                               "rope_theta": 1e6}
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=1000,
                                           video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(mode.dtype)
    try:
        with torch.device(mode.device):
            model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    return model.train()


def _fwd_bwd_seconds(fn, mode: Mode, repeats: int) -> float:
    """Fastest forward + backward of ``fn()`` after one warm-up call."""
    best = float("inf")
    for i in range(repeats + 1):
        _sync(mode.device)
        t0 = time.perf_counter()
        fn().sum().backward()
        _sync(mode.device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def section_vlm_phases(mode: Mode, deadline: float) -> dict:
    from evenflow.balance import fit_quadratic
    from evenflow.vlm import QwenVLAdapter
    from evenflow.vlm.flops import llm_example_flops, vision_frame_flops

    model = build_qwen2_5_vl(mode)
    adapter = QwenVLAdapter(model)
    vision_cfg = model.config.vision_config.to_dict()
    text_cfg = dict(model.config.text_config.to_dict(), head_dim=model.config.text_config.hidden_size
                    // model.config.text_config.num_attention_heads)
    sizes = VLM_SIZES["cpu" if mode.reduced else "gpu"]
    vocab = model.config.text_config.vocab_size
    rows, skipped = {"vision": [], "llm": []}, []
    for phase in ("vision", "llm"):
        for size in sizes[phase]:
            if time.perf_counter() > deadline:
                skipped.append([phase, size, "budget"])
                continue
            if phase == "vision":
                x, item_rows, meta = adapter.warmup_item("vision", size)
                x = x.to(device=mode.device, dtype=mode.dtype)
                side = int(meta[0, 2])
                flops = float(vision_frame_flops(side, side, vision_cfg))

                def fn(x=x, item_rows=item_rows, meta=meta):
                    return adapter.encode("vision", x, item_rows, meta)
                actual = side * side
            else:
                ids = (torch.arange(size, device=mode.device) % (vocab // 2) + 1)[None]
                flops = float(llm_example_flops(size, text_cfg))

                def fn(ids=ids):
                    return model(input_ids=ids, use_cache=False).logits
                actual = size
            try:
                seconds = _fwd_bwd_seconds(fn, mode, repeats=1 if mode.reduced else 3)
            except torch.OutOfMemoryError:
                skipped.append([phase, size, "oom"])
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            model.zero_grad(set_to_none=True)
            rows[phase].append({"size": actual, "seconds": seconds, "flops": flops, "tflops_per_s": flops / seconds / 1e12})
    fits = {}
    for phase, r in rows.items():
        if len({x["size"] for x in r}) >= 3:
            c = fit_quadratic([x["size"] for x in r], [x["seconds"] for x in r])
            fits[phase] = {"gamma": c.gamma, "alpha": c.alpha, "beta": c.beta}
    peak = torch.cuda.max_memory_allocated() / 2**30 if mode.device == "cuda" else None
    params = sum(p.numel() for p in model.parameters())
    del model, adapter
    if mode.device == "cuda":
        torch.cuda.empty_cache()
    return {"params": params, "dtype": str(mode.dtype), "phases": rows, "fit": fits, "skipped": skipped,
            "peak_gib": peak, "note": "fit: seconds of one vision frame of L patch rows / one example of L tokens; "
                                      "give it to VLMConfig(time_cost=...) as PhaseTime on num_patches / tokens"}


# -- 6. packed FlashAttention-2 against sdpa ---------------------------------------------------------------------

def flash_attn_available(mode: Mode) -> str | None:
    """Why the flash-attention check cannot run here, or None."""
    import importlib.util

    if mode.device != "cuda":
        return "no CUDA device"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn absent"
    return None


def section_flash_attn(mode: Mode, deadline: float) -> dict:
    """The same packed row through FlashAttention-2 and sdpa (same weights): logits and every gradient."""
    del deadline
    why = flash_attn_available(mode)
    if why is not None:
        return {"skipped": why}
    model = build_qwen2_5_vl(mode)
    text = model.model.language_model
    lengths = FLASH_LENGTHS["gpu"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, model.config.text_config.vocab_size // 2, (1, sum(lengths)), generator=gen).to(mode.device)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(mode.device)[None]
    position_ids = torch.cat([pos[None], pos[None].expand(3, 1, -1)])  # [4, 1, N]: text row, then M-RoPE

    def run(impl: str, ids=ids, position_ids=position_ids):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        logits.float().square().mean().backward()
        grads = {n: p.grad.detach().float().clone() for n, p in text.named_parameters() if p.grad is not None}
        return logits.detach().float(), grads

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    sdpa_logits, sdpa_grads = run("sdpa")
    fa_logits, fa_grads = run("flash_attention_2")
    alone = []  # each example on its own row: what packing must reproduce
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        start = 0
        for n in lengths:
            p = torch.arange(n, device=mode.device)[None]
            alone.append(model(input_ids=ids[:, start:start + n], position_ids=torch.cat([p[None], p[None].expand(3, 1, -1)]),
                               use_cache=False).logits.float())
            start += n
    alone = torch.cat(alone, dim=1)
    out = {"lengths": list(lengths), "dtype": str(mode.dtype),
           "logits_rel_err_fa_vs_sdpa": rel(fa_logits, sdpa_logits),
           "grad_rel_err_fa_vs_sdpa_max": max(rel(fa_grads[n], sdpa_grads[n]) for n in sdpa_grads),
           "logits_rel_err_fa_vs_alone": rel(fa_logits, alone), "logits_rel_err_sdpa_vs_alone": rel(sdpa_logits, alone)}
    out["equal"] = bool(out["logits_rel_err_fa_vs_sdpa"] <= FLASH_TOL and out["grad_rel_err_fa_vs_sdpa_max"] <= FLASH_TOL
                        and out["logits_rel_err_fa_vs_alone"] <= FLASH_TOL)
    del model
    torch.cuda.empty_cache()
    return out


FLASH_TOL = 2e-2
"""bf16: two kernels summing in different orders agree to about 1e-2 (a packing bug -- examples attending to each
other -- is off by tens of percent)."""


# -- driver ------------------------------------------------------------------------------------------------------

SECTIONS = {"llm_step": section_llm_step, "loader": section_loader, "orchestrator": section_orchestrator,
            "vlm_phases": section_vlm_phases, "flash_attn": section_flash_attn}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock cap for the whole run (seconds)")
    ap.add_argument("--out", default=None, help="append JSON lines here as well as to stdout")
    ap.add_argument("--cpu-reduced", action="store_true", help="CPU, gloo, tiny shapes (the test suite's mode)")
    ap.add_argument("--only", nargs="*", choices=sorted(SECTIONS), default=None)
    args = ap.parse_args(argv)
    mode = resolve_mode(args.cpu_reduced)
    if mode.reduced:
        torch.set_num_threads(1)  # the suite shares a small CPU machine
    emit = Emitter(args.out)
    start = time.perf_counter()
    emit("env", **section_env(mode))
    status = {}
    for name, fn in SECTIONS.items():
        if args.only is not None and name not in args.only:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 5:
            status[name] = "skipped (budget)"
            emit(name, ok=False, skipped="budget")
            continue
        deadline = time.perf_counter() + min(left, SECTION_SHARE[name] * args.budget_s)
        try:
            result = fn(mode, deadline)
            ok = not (name == "orchestrator" and not all(r["ok"] for r in result["ranks"])) \
                and result.get("equal", True)
            why = result.get("skipped")  # a reason (str) when the whole section could not run here; sizes cut
            status[name] = f"skipped ({why})" if isinstance(why, str) else "ok" if ok else "failed"  # short: a list
            emit(name, ok=ok, **result)
        except Exception as exc:  # noqa: BLE001 - one failed section must not lose the others
            status[name] = "failed"
            emit(name, ok=False, error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
    emit("summary", final=True, mode="cpu-reduced" if mode.reduced else "gpu", sections=status,
         total_s=round(time.perf_counter() - start, 2), budget_s=args.budget_s)
    # A check that cannot run here (no flash-attn) is not a failure; one cut short by the budget is.
    return 0 if all(v == "ok" or v.startswith("skipped (") and "budget" not in v for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
