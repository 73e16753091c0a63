"""One rank of the demo: every arm trains the same tiny Qwen3 model for one epoch, in interleaved timed chunks.

The arms share everything but the batching (evenflow.demo.arms): the model init (seeded), its attention
(NOTE [ Packed attention on CPU ] in evenflow.demo.attention), AdamW, the LR schedule in each arm's optimizer
steps ([`schedule_factor()`][evenflow.demo.config.schedule_factor]; a token LR rule only if ``DemoConfig.lr_scaling``
asks, [`evenflow.TokenLRScaler`][evenflow.TokenLRScaler]), gradient clipping, DDP over gloo, one DataLoader worker per
rank, and the exact global per-token loss (NOTE [ Loss scale ] in evenflow.planning.loss): every
rank backpropagates ``sum_loss_r * W / T_window`` so DDP's gradient average is the per-token mean of the whole
optimizer step.

NOTE [ Interleaved timing ]
    Each arm's epoch is cut into ``rounds`` chunks of optimizer steps. Round r runs one chunk of every arm, in
    forward order on even rounds and reversed on odd ones (A B C, C B A, ...), each chunk between two barriers.
    The first chunk of an arm includes its DataLoader worker's start, the last its shutdown (the same for every
    arm; the median over the rounds does not rest on either).
    A load burst on the shared machine then hits every arm about equally instead of whichever ran second, and
    each round gives one throughput sample per arm. The model, optimizer and loader of every arm live on
    across chunks, so quality is still one seeded full run per arm: interleaving changes the timing, not the
    training. Held-out evaluations between chunks are not timed. Caveat: a paused arm's loader workers may
    prepare their next batches while another arm is timed (about 1-2 ms of tokenization per chat, against
    tens of ms of training).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..integrations.mesh import destroy_process_groups
from ..lr import TokenLRScaler
from ..planning.loss import IGNORE_INDEX
from .arms import PAD_ID, Window, arm_windows, batch_cost
from .attention import register as register_attention
from .config import DemoConfig, arm_lr_scaling, schedule_factor
from .plan import Matching
from .prepare import DemoData

__all__ = ["rank_main", "build_model", "sum_loss", "ArmRun"]

LOGIT_CHUNK = 512
"""Supervised positions per lm_head + cross-entropy chunk (512 x 4,096 fp32 logits = 8 MB)."""


def build_model(config: DemoConfig, vocab_size: int, *, attention: str = "sdpa") -> torch.nn.Module:
    """A tiny Qwen3-architecture causal LM, random init from ``config.seed`` (no weights are downloaded).

    ``attention``: transformers' attention implementation. The demo's ranks pass
    [`evenflow.demo.attention.ATTENTION`][evenflow.demo.attention.ATTENTION] (NOTE [ Packed attention on CPU ]); the
    default, stock ``sdpa``, is what ``benchmarks/quality_replay.py`` trains with (the same math).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(config.seed)
    model_config = Qwen3Config(vocab_size=vocab_size, hidden_size=config.hidden_size,
                               intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                               num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                               head_dim=config.hidden_size // config.num_heads, max_position_embeddings=config.cutoff,
                               tie_word_embeddings=True, pad_token_id=PAD_ID, bos_token_id=None, eos_token_id=None,
                               use_cache=False, attn_implementation=attention)
    return Qwen3ForCausalLM(model_config)


def sum_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over supervised positions, and their count.

    Three CPU-efficiency choices, the same for every arm and exact:

    * No attention mask for padded batches. They are right-padded and attention is causal, so a real token
      never attends to a pad (pads come after it); the mask would change only the pads' outputs, which the
      loss ignores. Without it, SDPA takes its fused causal path instead of materializing a ``[B, H, T, T]`` mask.
    * A packed batch (``position_ids``, no mask) attends within each sequence: one causal call per sequence
      under the demo's attention (NOTE [ Packed attention on CPU ] in evenflow.demo.attention), HF's
      block-diagonal mask from the restarting positions under stock ``sdpa``; ``use_cache=False`` either way
      (NOTE [ Packing and the KV cache ] in evenflow.runtime.collate).
    * Logits only where a label is supervised, ``LOGIT_CHUNK`` rows at a time: a 4,096-token batch would
      otherwise hold 4,096 x vocab fp32 logits at once, which on CPU costs more in memory traffic than in math.
    """
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    hidden = model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]
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


class ArmRun:
    """One arm on one rank: model, optimizer, schedule, LR rule and its window stream, advanced chunk by chunk."""

    def __init__(self, arm: str, data: DemoData, config: DemoConfig, matching: Matching, rank: int) -> None:
        self.arm = arm
        self.config = config
        self.total_steps = matching.arms[arm].optimizer_steps
        self.model = build_model(config, data.vocab_size, attention=register_attention())
        # forward_sync_buffers=False: DDP would otherwise broadcast the buffers (here only the rotary constants,
        # equal on every rank by construction) in every forward, and the HF arms' ranks take 4 or 5 micro-batches
        # in the same step (8 or 9 samples dealt to 2 ranks): unequal broadcasts would mismatch the collectives.
        self.ddp = DistributedDataParallel(self.model, forward_sync_buffers=False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=config.base_lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda step: schedule_factor(step, self.total_steps, config))
        self.scaler = TokenLRScaler(self.opt, scaling=arm_lr_scaling(arm, config),
                                    reference_tokens=matching.reference_tokens)
        self.windows: Iterator[Window] = arm_windows(arm, data, config, matching, rank)
        self.steps = 0
        self.records: list[dict] = []
        """Per micro-batch: its optimizer step, samples, real/cost tokens, loss sum, CPU seconds."""
        self.lrs: list[float] = []
        """The LR every optimizer step used (schedule x rule)."""
        self.exhausted = False

    def run_chunk(self, max_steps: int | None) -> dict[str, Any]:
        """Up to ``max_steps`` optimizer steps (``None``: to the end of the epoch), timed between barriers."""
        dist.barrier()
        start, samples, taken, first = time.perf_counter(), 0, 0, len(self.records)
        while max_steps is None or taken < max_steps:
            window = next(self.windows, None)
            if window is None:
                self.exhausted = True
                break
            self._step(window)
            samples += window.global_samples
            taken += 1
        dist.barrier()
        wall = time.perf_counter() - start
        # The chunk's real tokens over all ranks (after the timed span): the per-round rate is tokens/s, because
        # chunks of equal steps hold very different sample counts (NOTE [ Time model ] in evenflow.demo.report).
        tokens = torch.tensor([sum(rec["real"] for rec in self.records[first:])], dtype=torch.long)
        dist.all_reduce(tokens)
        return {"wall_s": wall, "samples": samples, "real_tokens": int(tokens), "steps": taken}

    def _step(self, window: Window) -> None:
        factor = self.config.world_size / window.global_tokens if window.global_tokens else 0.0
        for i, micro in enumerate(window.micros):
            # CPU time of this thread (forward, backward, optimizer; not time spent waiting for a peer rank or
            # for the CPU itself): the per-rank work of the step, robust to other load on a shared machine.
            cpu_start = time.thread_time()
            last = i == len(window.micros) - 1
            with self.ddp.no_sync() if not last else nullcontext():
                loss, tokens = sum_loss(self.ddp, micro.batch)
                (loss * (0.0 if micro.idle else factor)).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
                self.scaler.observe(window.global_tokens)
                self.opt.step()
                self.lrs.append(self.scaler.last_lrs[0])
                self.opt.zero_grad(set_to_none=True)
                self.schedule.step()
            real, cost = batch_cost(micro.batch)
            self.records.append({"step": self.steps, "samples": micro.samples, "real": 0 if micro.idle else real,
                                 "padded": 0 if micro.idle else cost,
                                 "loss_tokens": 0 if micro.idle else tokens, "loss_sum": loss.item(),
                                 "cpu_s": time.thread_time() - cpu_start})
        self.steps += 1


def heldout_loss(model: torch.nn.Module, data: DemoData, rank: int, world: int) -> float:
    """Per-token loss over the held-out samples (one sample per forward, no padding), all ranks summed."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(data.heldout), world):
            sample = data.heldout[i]
            loss, tokens = sum_loss(model, {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]})
            total += torch.tensor([loss.item(), tokens], dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1]) if total[1] else float("nan")


def _warm_up(config: DemoConfig, data: DemoData) -> None:
    """One untimed forward/backward on a throwaway model and one pipeline call, so one-time costs (lazy
    imports in transformers, kernel selection, tokenizer load) land in no arm's timing."""
    sample = data.train[0]
    loss, _ = sum_loss(build_model(config, data.vocab_size, attention=register_attention()),
                       {"input_ids": sample["input_ids"][None], "labels": sample["labels"][None]})
    loss.backward()


def chunk_bounds(total: int, rounds: int) -> list[int]:
    """Optimizer steps per chunk: ``total`` split as evenly as possible; ``None`` (drain) for the last.

    >>> chunk_bounds(10, 4)
    [2, 3, 3, None]
    """
    edges = [round(total * (r + 1) / rounds) for r in range(rounds)]
    sizes = [b - a for a, b in zip([0, *edges], edges)]
    return [*sizes[:-1], None]


def _interleaved(runs: list[ArmRun], data: DemoData, config: DemoConfig, rank: int,
                 progress: bool) -> dict[str, Any]:
    """NOTE [ Interleaved timing ]: every arm's epoch in ``rounds`` chunks, ABBA order, evaluated between."""
    initial = heldout_loss(runs[0].model, data, rank, config.world_size)  # every arm starts from this init
    chunks: dict[str, list[dict]] = {run.arm: [] for run in runs}
    plans = {run.arm: chunk_bounds(run.total_steps, config.rounds) for run in runs}
    for r in range(config.rounds):
        for run in runs if r % 2 == 0 else runs[::-1]:
            chunk = run.run_chunk(plans[run.arm][r])
            chunk.update(round=r, load1=os.getloadavg()[0],
                         heldout=heldout_loss(run.model, data, rank, config.world_size))
            chunks[run.arm].append(chunk)
        if progress and rank == 0:  # one line a round: the demo's whole output stays within a screen
            rates = "  ".join(f"{run.arm} {chunks[run.arm][-1]['real_tokens'] / chunks[run.arm][-1]['wall_s']:.0f}"
                              for run in runs)
            print(f"  round {r + 1}/{config.rounds}, real tokens/s: {rates}", file=sys.stderr, flush=True)
    return {"initial_heldout": initial, "chunks": chunks}


def rank_main(rank: int, config: DemoConfig, data: DemoData, matching: Matching, rendezvous: str,
              result_path: str, progress: bool) -> None:
    """Entry point of one spawned rank: all arms, interleaved; then rank 0 writes the raw results as JSON."""
    torch.set_num_threads(1)  # one core per rank: the ranks, not intra-op threads, share the CPU
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=config.world_size, timeout=timedelta(seconds=config.timeout_s))
    try:
        _all_arms(config, data, matching, rank, result_path, progress)
    finally:
        destroy_process_groups()  # after _all_arms's models and loaders are gone: nothing left for interpreter exit


def _all_arms(config: DemoConfig, data: DemoData, matching: Matching, rank: int, result_path: str,
              progress: bool) -> None:
    """Every arm of one rank; its models and loaders are freed when it returns, before the groups go."""
    _warm_up(config, data)
    runs = [ArmRun(arm, data, config, matching, rank) for arm in config.arms]
    timing = _interleaved(runs, data, config, rank, progress)
    results = {"initial_heldout": timing["initial_heldout"], "arms": {}}
    for run in runs:
        gathered: list[Any] = [None] * config.world_size
        dist.all_gather_object(gathered, run.records)
        results["arms"][run.arm] = {"chunks": timing["chunks"][run.arm], "per_rank_steps": gathered,
                                    "optimizer_steps": run.steps, "planned_steps": run.total_steps,
                                    "lrs": run.lrs, "exhausted": run.exhausted}
    results["model_parameters"] = sum(p.numel() for p in runs[0].model.parameters())
    if rank == 0:
        with open(result_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
