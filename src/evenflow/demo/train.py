"""One rank of the demo: the same tiny Qwen3 model trained for one epoch with evenflow, then with fixed batches.

Both runs share everything but the batching: the model init (seeded), AdamW, the learning-rate rule
(:func:`~evenflow.demo.config.lr_for_step`), gradient clipping, DDP over gloo, one DataLoader worker per rank,
and the exact global per-token loss (NOTE [ Loss scale ] in evenflow.planning.loss): every rank
backpropagates ``sum_loss_r * W / T_tok`` so DDP's gradient average is the per-token mean of the whole step.
The fixed run gets ``T_tok`` from one all_reduce per step (what HF's ``average_tokens_across_devices`` does);
evenflow's StepInfo carries it.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ..planning.loss import IGNORE_INDEX
from ..runtime import DynamicBatchLoader, PadCollate, pop_step_info, scale_loss
from .config import DemoConfig, lr_for_step
from .prepare import DemoData

__all__ = ["rank_main", "build_model"]

PAD_ID = 0
"""Dense id used for padding (the remap's unk); padded positions are labelled -100."""
LOGIT_CHUNK = 512
"""Supervised positions per lm_head + cross-entropy chunk (512 x 4,096 fp32 logits = 8 MB)."""


def build_model(config: DemoConfig, vocab_size: int) -> torch.nn.Module:
    """A tiny Qwen3-architecture causal LM, random init from ``config.seed`` (no weights are downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(config.seed)
    model_config = Qwen3Config(vocab_size=vocab_size, hidden_size=config.hidden_size,
                               intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                               num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                               head_dim=config.hidden_size // config.num_heads, max_position_embeddings=config.cutoff,
                               tie_word_embeddings=True, pad_token_id=PAD_ID, bos_token_id=None, eos_token_id=None)
    return Qwen3ForCausalLM(model_config)


def _sum_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over supervised positions, and their count.

    Two CPU-efficiency choices, the same for both runs and exact:

    * No attention mask. Batches are right-padded and attention is causal, so a real token never attends to
      a pad (pads come after it); the mask would change only the pads' outputs, which the loss ignores.
      Without it, SDPA takes its fused causal path instead of materializing a ``[B, H, T, T]`` mask.
    * Logits only where a label is supervised, ``LOGIT_CHUNK`` rows at a time: a 4,096-token batch would
      otherwise hold 4,096 x vocab fp32 logits at once, which on CPU costs more in memory traffic than in math.
    """
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    hidden = model(input_ids=batch["input_ids"], logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    # Start from 0 * sum(hidden), not a constant: a batch with no supervised token (an IDLE placeholder, or a
    # chat cut before its first reply) must still backpropagate, or DDP's gradient all-reduce would hang.
    loss = hidden.sum().float() * 0.0
    hidden, targets = hidden[:, :-1][keep], labels[keep]
    for start in range(0, targets.numel(), LOGIT_CHUNK):
        logits = unwrapped.lm_head(hidden[start:start + LOGIT_CHUNK]).float()
        loss = loss + F.cross_entropy(logits, targets[start:start + LOGIT_CHUNK], reduction="sum")
    return loss, int(targets.numel())


def _fixed_steps(data: DemoData, config: DemoConfig, batch_size: int, rank: int) -> Iterator[tuple[dict, dict]]:
    """Fixed-size batches from a DistributedSampler; one all_reduce per step for the global token count."""
    sampler = DistributedSampler(data.train, num_replicas=config.world_size, rank=rank, shuffle=True,
                                 seed=config.seed, drop_last=False)
    loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, num_workers=config.num_workers,
                        collate_fn=PadCollate(pad_token_id=PAD_ID))
    for batch in loader:
        local = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        counts = torch.tensor([local, batch["input_ids"].shape[0]], dtype=torch.long)
        dist.all_reduce(counts)
        yield batch, {"idle": False, "global_tokens": int(counts[0]), "global_samples": int(counts[1])}


def _evenflow_steps(data: DemoData, config: DemoConfig) -> Iterator[tuple[dict, dict]]:
    loader = DynamicBatchLoader(data.train, token_budget=config.token_budget, num_workers=config.num_workers,
                                seed=config.seed, shuffle=True, pad_token_id=PAD_ID,
                                timeout=timedelta(seconds=config.timeout_s))
    try:
        for batch in loader:
            info = pop_step_info(batch)
            yield batch, {"idle": info.is_idle, "global_tokens": info.window_loss_tokens,
                          "global_samples": info.global_samples, "info": info}
    finally:
        loader.close()


def _run_epoch(mode: str, data: DemoData, config: DemoConfig, rank: int, fixed_batch_size: int,
               progress: bool) -> dict[str, Any]:
    model = build_model(config, data.vocab_size)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=config.base_lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps = _fixed_steps(data, config, fixed_batch_size, rank) if mode == "fixed" else _evenflow_steps(data, config)
    bar = _progress_bar(mode, len(data.train), enabled=progress and rank == 0)
    records = []
    dist.barrier()
    start = time.perf_counter()
    for batch, meta in steps:
        lr = lr_for_step(config, meta["global_tokens"])
        for group in opt.param_groups:
            group["lr"] = lr
        # CPU time of this thread (forward, backward, optimizer; not time spent waiting for a peer rank or
        # for the CPU itself): the per-rank work of the step, robust to other load on a shared machine.
        cpu_start = time.thread_time()
        sum_loss, local_tokens = _sum_loss(ddp, batch)
        if mode == "fixed":
            factor = config.world_size / meta["global_tokens"] if meta["global_tokens"] else 0.0
            scaled = sum_loss * factor
        else:
            scaled = scale_loss(sum_loss, meta["info"], reduction="sum")
        opt.zero_grad(set_to_none=True)
        scaled.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        opt.step()
        cpu = time.thread_time() - cpu_start
        rows, width = batch["input_ids"].shape
        real = 0 if meta["idle"] else int(batch["attention_mask"].sum())
        records.append({"samples": 0 if meta["idle"] else rows, "real": real, "padded": rows * width,
                        "loss_tokens": 0 if meta["idle"] else local_tokens, "loss_sum": sum_loss.item(),
                        "global_tokens": meta["global_tokens"], "lr": lr, "cpu_s": cpu})
        if bar is not None:
            bar.update(meta["global_samples"])
            if local_tokens:
                bar.set_postfix(loss=f"{records[-1]['loss_sum'] / local_tokens:.3f}", refresh=False)
    dist.barrier()
    wall = time.perf_counter() - start
    if bar is not None:
        bar.close()
    heldout = _heldout_loss(model, data, rank, config.world_size)
    gathered: list[Any] = [None] * config.world_size
    dist.all_gather_object(gathered, records)
    return {"wall_s": wall, "heldout_loss": heldout, "per_rank_steps": gathered,
            "model_parameters": sum(p.numel() for p in model.parameters())}


def _heldout_loss(model: torch.nn.Module, data: DemoData, rank: int, world: int) -> float:
    """Per-token loss over the held-out samples (one sample per forward, no padding), all ranks summed."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(data.heldout), world):
            sample = data.heldout[i]
            ids = sample["input_ids"][None]
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": sample["labels"][None]}
            loss, tokens = _sum_loss(model, batch)
            total += torch.tensor([loss.item(), tokens], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1]) if total[1] else float("nan")


def _warm_up(config: DemoConfig, data: DemoData) -> None:
    """One untimed forward/backward on a throwaway model and one pipeline call, so one-time costs (lazy
    imports in transformers, kernel selection, tokenizer load) land in neither run's timing."""
    sample = data.train[0]
    model = build_model(config, data.vocab_size)
    loss, _ = _sum_loss(model, {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]})
    loss.backward()


def _progress_bar(mode: str, total: int, *, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{mode:>8}", unit="sample", file=sys.stderr, dynamic_ncols=True, leave=True)


def rank_main(rank: int, config: DemoConfig, data: DemoData, rendezvous: str, result_path: str,
              fixed_batch_size: int, progress: bool) -> None:
    """Entry point of one spawned rank: both runs, then rank 0 writes the raw results as JSON."""
    torch.set_num_threads(1)  # one core per rank: the ranks, not intra-op threads, share the CPU
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s))
    try:
        _warm_up(config, data)
        # evenflow runs first: whatever the second run still gains from warm caches goes to the baseline.
        results = {mode: _run_epoch(mode, data, config, rank, fixed_batch_size, progress)
                   for mode in ("evenflow", "fixed")}
        if rank == 0:
            with open(result_path, "w", encoding="utf-8") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
