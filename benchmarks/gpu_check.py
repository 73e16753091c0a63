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
7. ``context_parallel`` -- torch's ``context_parallel`` (ring attention, head-tail load balancer) on the loader's
   shard-ready batches (``mesh=``, ``cp_dim="cp"``, one odd-length document per row, padded to 2 x cp) against
   the unsharded forward: the loss and every gradient summed over the CP ranks, and torch's shard against
   ``evenflow.shard_batch``. Two ranks (NCCL on two GPUs, gloo sharing one). Skipped (not failed) without CUDA.

8. ``vlm_prefetch`` -- the balanced step of the Qwen2.5-VL-shaped model through the loader, with its metadata
   exchange and plan inline or made on the loader's collation thread (``VLMConfig(prefetch=True)``): per
   iteration wall time (step, backward, the wait for the next batch) of each arm, ABBA-interleaved on the same
   model and epoch, and their losses equal. One rank per GPU (one GPU: one rank, nothing moves, what the
   background hides is the step's own examples, metadata and plan).

``--cpu-reduced`` runs the same code on CPU (gloo, fp32, a 2-layer model, 2 ranks, small shapes, a tiny
Qwen2.5-VL) so that the suite keeps it from rotting; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
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
SECTION_SHARE = {"llm_step": 0.3, "loader": 0.15, "orchestrator": 0.2, "vlm_phases": 0.25, "flash_attn": 0.1,
                 "context_parallel": 0.1, "vlm_prefetch": 0.15}
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


def _orch_child(rank: int, world: int, tmp: str, mode: Mode, body: str = "orchestrator") -> None:
    import torch.distributed as dist

    out = os.path.join(tmp, f"rank{rank}.json")
    try:
        torch.set_num_threads(1)
        dist.init_process_group(mode.backend, init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        try:
            result = {"ok": True, **RANK_BODIES[body](rank, world, mode)}
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)


def _run_ranks(mode: Mode, deadline: float, body: str) -> list[dict]:
    """``RANK_BODIES[body]`` on ``mode.world`` spawned ranks (file rendezvous), each rank's JSON result."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        procs = [ctx.Process(target=_orch_child, args=(r, mode.world, tmp, mode, body)) for r in range(mode.world)]
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
    return ranks


def section_orchestrator(mode: Mode, deadline: float) -> dict:
    ranks = _run_ranks(mode, deadline, "orchestrator")
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


# -- 7. torch context_parallel with the loader's batches ----------------------------------------------------------

CP_LENGTHS = {"gpu": (4093, 1021, 2047, 3001), "cpu": (29, 13, 7, 31)}
"""One document per batch (torch's ring attention masks causally over the whole row: no packing); odd lengths,
so the loader pads each row to a multiple of 2 x cp."""
CP_TOL = 1e-4
"""fp32, relative: the sharded and the unsharded forward sum the same terms in other orders."""


def context_parallel_available(mode: Mode) -> str | None:
    """Why torch's ``context_parallel`` cannot run here, or None (it needs CUDA attention kernels)."""
    if mode.device != "cuda":
        return "no CUDA device"
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
    except ImportError:
        return "torch without context_parallel"
    return None


class _Documents(torch.utils.data.Dataset):
    def __init__(self, lengths, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def _cp_rank(rank: int, world: int, mode: Mode) -> dict:
    """Each loader batch: the unsharded forward+backward, then the same under ``context_parallel`` over a cp mesh
    of every rank (the loader's mesh); losses and gradients summed over the CP ranks against the unsharded ones,
    and torch's head-tail shard against ``evenflow.shard_batch``."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import evenflow

    torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda", (1, world), mesh_dim_names=("dp", "cp"))
    model = build_qwen3(mode).float()
    lengths = CP_LENGTHS["gpu"]
    loader = evenflow.DynamicBatchLoader(_Documents(lengths, model.config.vocab_size), cost="padded", max_samples=1,
                                         token_budget=-(-max(lengths) // (2 * world)) * 2 * world, shuffle=False,
                                         mesh=mesh, dp_dims=("dp",), cp_dim="cp")
    group, rows = mesh["cp"].get_group(), []
    for batch in loader:
        evenflow.pop_step_info(batch)
        ids, pos, shift = (batch[k].cuda() for k in ("input_ids", "position_ids", "shift_labels"))

        def step(i, p, s):
            model.zero_grad(set_to_none=True)
            # An all-ones mask keeps HF off its packed-row detection (a shard's positions jump at the head-tail
            # seam) and on the causal kernel path context_parallel shards: the mask itself is never built.
            logits = model(input_ids=i, position_ids=p, attention_mask=torch.ones_like(i), use_cache=False).logits
            logits = logits.float()
            loss = F.cross_entropy(logits.flatten(0, 1), s.flatten(), reduction="sum")
            loss.backward()
            return loss.detach(), {n: q.grad.detach().clone() for n, q in model.named_parameters()
                                   if q.grad is not None}

        ref_loss, ref_grads = step(ids, pos, shift)
        expected = evenflow.shard_batch({"input_ids": ids}, loader.mesh)["input_ids"]
        bufs = [ids.clone(), pos.clone(), shift.clone()]
        with context_parallel(mesh["cp"], buffers=bufs, buffer_seq_dims=[1, 1, 1]):
            same_split = bool(torch.equal(bufs[0], expected))
            loss, grads = step(*bufs)
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        rel = {n: float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()}
        rows.append({"tokens": int(ids.shape[1]), "same_split_as_shard_batch": same_split,
                     "loss_rel_err": float((loss - ref_loss).abs() / ref_loss.abs()),
                     "grad_rel_err_max": max(rel.values())})
    return {"batches": rows}


def section_context_parallel(mode: Mode, deadline: float) -> dict:
    """torch ``context_parallel`` (ring attention, head-tail balanced) on the loader's shard-ready batches against
    the unsharded forward. Two ranks: NCCL on two GPUs; on one GPU both ranks share it over gloo."""
    why = context_parallel_available(mode)
    if why is not None:
        return {"skipped": why}
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    ranks = _run_ranks(dataclasses.replace(mode, world=2, backend=backend), deadline, "context_parallel")
    out = {"world": 2, "backend": backend, "ranks": ranks}
    if all(r["ok"] for r in ranks):
        rows = ranks[0]["batches"]
        out["equal"] = all(r["same_split_as_shard_batch"] and r["loss_rel_err"] <= CP_TOL
                           and r["grad_rel_err_max"] <= CP_TOL for r in rows)
    else:
        out["equal"] = False
    return out


# -- 8. the balanced step with its plan made in the loader's thread --------------------------------------------

PREFETCH_SHAPES = {"gpu": dict(samples=64, text=(256, 1024), side=(16, 48), budget=4096, steps=6, rounds=2),
                   "cpu": dict(samples=16, text=(8, 24), side=(2, 4), budget=64, steps=3, rounds=1)}
"""Per rank: samples (one image each, grids ``side`` x ``side`` patches of 14 px, text tokens in ``text``), the
loader's token budget, steps timed per arm and round, ABBA rounds."""


def _prefetch_samples(world: int, mode: Mode) -> list[dict]:
    """One random image and some text per sample (Qwen2.5-VL's layout, ids 1000-1003 as built); the same list
    on every rank (the loader shards it)."""
    shape = PREFETCH_SHAPES["cpu" if mode.reduced else "gpu"]
    gen = torch.Generator().manual_seed(10)
    out = []
    for _ in range(shape["samples"] * world):
        h, w = (2 * int(torch.randint(shape["side"][0] // 2, shape["side"][1] // 2 + 1, (1,), generator=gen))
                for _ in range(2))
        text = int(torch.randint(*shape["text"], (1,), generator=gen))
        ids = torch.cat([torch.tensor([1002]), torch.full((h * w // 4,), 1000), torch.tensor([1003]),
                         torch.randint(1, 900, (text,), generator=gen)])
        labels = torch.where(ids >= 1000, -100, ids)
        out.append({"input_ids": ids, "labels": labels, "mm_token_type_ids": (ids == 1000).long(),
                    "pixel_values": torch.randn(h * w, 1176, generator=gen),
                    "image_grid_thw": torch.tensor([[1, h, w]])})
    return out


def _prefetch_rank(rank: int, world: int, mode: Mode) -> dict:
    """Inline and prefetched arms, ABBA, on one model and the same epoch: per-iteration wall time (the step,
    its backward and the wait for the next batch) and the losses (no optimizer step: the arms see the same
    parameters, so their losses must be equal)."""
    import torch.distributed as dist

    import evenflow
    from evenflow.vlm import BalancedVLM, VLMConfig

    device = torch.device(mode.device, rank) if mode.device == "cuda" else torch.device("cpu")
    if mode.device == "cuda":
        torch.cuda.set_device(device)
    shape = PREFETCH_SHAPES["cpu" if mode.reduced else "gpu"]
    model = build_qwen2_5_vl(dataclasses.replace(mode, device=str(device)))
    data = _prefetch_samples(world, mode)
    gloo, group = dist.new_group(backend="gloo"), dist.new_group(backend=mode.backend)
    vlms = {arm: BalancedVLM(model, group=group, config=VLMConfig(prefetch=arm == "prefetched",
                                                                  gradient_sync="unchecked"))
            for arm in ("inline", "prefetched")}
    times: dict = {"inline": [], "prefetched": []}
    losses: dict = {}
    epoch = 0
    for arm in ["inline", "prefetched", "prefetched", "inline"] * shape["rounds"]:
        loader = evenflow.DynamicBatchLoader(data, token_budget=shape["budget"], cost="summed", planning="local",
                                             shuffle=False, buffer_size=16, process_group=gloo)
        if arm == "prefetched":
            vlms[arm].prefetch_from(loader)
        loader.set_epoch(epoch)
        seen, last = [], None
        for i, batch in enumerate(loader):
            now = time.perf_counter()  # one iteration: from one batch's arrival to the next one's
            if i > 1:  # the first step warms up
                times[arm].append(now - last)
            last = now
            info = evenflow.pop_step_info(batch)
            step = vlms[arm](batch, info)
            step.loss.backward()
            model.zero_grad(set_to_none=True)
            _sync(mode.device)
            seen.append(step.loss_sum)
            if i + 1 >= shape["steps"] + 2:
                break
        loader.close()
        losses.setdefault(arm, seen)
    ms = {a: 1e3 * np.asarray(v) for a, v in times.items()}
    return {"iteration_ms": {a: {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
                                 "n": int(v.size)} for a, v in ms.items()},
            "losses_equal": losses["inline"] == losses["prefetched"], "steps": len(losses["inline"])}


def section_vlm_prefetch(mode: Mode, deadline: float) -> dict:
    """The balanced step of a Qwen2.5-VL-shaped model with its metadata exchange and plan inline or made on the
    loader's collation thread (``VLMConfig(prefetch=True)``): iteration times side by side, losses equal."""
    ranks = _run_ranks(mode, deadline, "vlm_prefetch")
    out = {"world": mode.world, "ranks": ranks, "equal": all(r["ok"] and r["losses_equal"] for r in ranks)}
    if all(r["ok"] for r in ranks):
        med = {a: float(np.median([r["iteration_ms"][a]["median"] for r in ranks])) for a in ("inline", "prefetched")}
        out["median_iteration_ms"] = med
        out["prefetched_over_inline"] = med["prefetched"] / med["inline"]
    return out


RANK_BODIES = {"orchestrator": _orch_rank, "context_parallel": _cp_rank, "vlm_prefetch": _prefetch_rank}
"""What a spawned rank runs, by section (``_orch_child``)."""


# -- driver ------------------------------------------------------------------------------------------------------

SECTIONS = {"llm_step": section_llm_step, "loader": section_loader, "orchestrator": section_orchestrator,
            "vlm_phases": section_vlm_phases, "flash_attn": section_flash_attn,
            "context_parallel": section_context_parallel, "vlm_prefetch": section_vlm_prefetch}


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
