"""The arms' batching, each as a stream of optimizer-step *windows* on one rank.

A window is the list of micro-batches of one optimizer step plus the step's global supervised-token count
(the denominator of the exact per-token loss and the input of the LR rule):

- ``fixed``: a seeded ``DistributedSampler`` (random order), batches of ``fixed_batch_size``, ``accumulation``
  micro-batches per window. The global token count takes one all_reduce per window, over the whole window
  fetched ahead -- what HF's Trainer does for ``num_items_in_batch`` with ``average_tokens_across_devices``.
- ``group_by_length``: the same, with HF's own ``get_length_grouped_indices`` (megabatches of 50 windows sorted
  by length, the longest first, as ``TrainingArguments(group_by_length=True)`` does with batch size x
  accumulation) and batches dealt round-robin to ranks as accelerate's ``BatchSamplerShard`` does.
- ``evenflow`` / ``evenflow_sqrt_lr``: :class:`evenflow.DynamicBatchLoader`, padded cost, one batch per step.
- ``evenflow_summed``: the same with ``cost="summed"``: one packed row per batch (``FlatCollate``:
  ``position_ids`` restart per sequence, ``use_cache=False``), exact with stock HF sdpa attention, which builds
  a block-diagonal mask from the restarting positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ..planning.loss import IGNORE_INDEX
from ..runtime import DynamicBatchLoader, PadCollate, pop_step_info
from .config import DemoConfig
from .plan import Matching
from .prepare import DemoData

__all__ = ["Window", "Micro", "arm_windows", "planned_steps", "PAD_ID"]

PAD_ID = 0
"""Dense id used for padding (the remap's unk); padded positions are labelled -100."""


@dataclass
class Micro:
    batch: dict
    idle: bool = False
    samples: int = 0
    """Real samples in this rank's micro-batch (0 for IDLE)."""


@dataclass
class Window:
    micros: list[Micro] = field(default_factory=list)
    global_tokens: int = 0
    global_samples: int = 0


def planned_steps(arm: str, matching: Matching) -> int:
    """Optimizer steps of the arm's epoch, known before training (its LR schedule's horizon)."""
    if arm in ("fixed", "group_by_length"):
        return matching.fixed_steps
    return matching.summed_steps if arm == "evenflow_summed" else matching.evenflow_steps


def arm_windows(arm: str, data: DemoData, config: DemoConfig, matching: Matching, rank: int) -> Iterator[Window]:
    if arm in ("fixed", "group_by_length"):
        return _fixed_windows(_fixed_loader(arm, data, config, matching, rank), matching.accumulation)
    return _evenflow_windows(data, config, cost="summed" if arm == "evenflow_summed" else "padded")


def _fixed_loader(arm: str, data: DemoData, config: DemoConfig, matching: Matching, rank: int) -> DataLoader:
    collate = PadCollate(pad_token_id=PAD_ID)
    b, world = matching.fixed_batch_size, config.world_size
    if arm == "fixed":
        sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True, seed=config.seed,
                                     drop_last=False)
        return DataLoader(data.train, batch_size=b, sampler=sampler, num_workers=config.num_workers,
                          collate_fn=collate)
    from transformers.trainer_pt_utils import get_length_grouped_indices

    order = get_length_grouped_indices(data.lengths.tolist(), b * matching.accumulation,
                                       generator=torch.Generator().manual_seed(config.seed))
    batches = [order[i:i + b] for i in range(0, len(order), b)]
    # accelerate's even_batches: every rank gets as many batches, the short ones refilled from the start.
    per_rank = -(-len(batches) // world)
    batches = batches + batches[:per_rank * world - len(batches)]
    return DataLoader(data.train, batch_sampler=batches[rank::world], num_workers=config.num_workers,
                      collate_fn=collate)


def _fixed_windows(loader: DataLoader, accumulation: int) -> Iterator[Window]:
    batches = iter(loader)
    while True:
        micros = []
        for batch in batches:
            micros.append(Micro(batch, samples=int(batch["input_ids"].shape[0])))
            if len(micros) == accumulation:
                break
        if not micros:
            return
        local = sum(int((m.batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micros)
        counts = torch.tensor([local, sum(m.samples for m in micros)], dtype=torch.long)
        dist.all_reduce(counts)
        yield Window(micros, global_tokens=int(counts[0]), global_samples=int(counts[1]))


def _evenflow_windows(data: DemoData, config: DemoConfig, *, cost: str) -> Iterator[Window]:
    loader = DynamicBatchLoader(data.train, token_budget=config.token_budget, num_workers=config.num_workers,
                                seed=config.seed, shuffle=True, pad_token_id=PAD_ID, cost=cost,
                                **({"buffer_size": config.buffer_size} if config.buffer_size else {}),
                                timeout=timedelta(seconds=config.timeout_s))
    try:
        for batch in loader:
            info = pop_step_info(batch)
            micro = Micro(batch, idle=info.is_idle, samples=info.local_samples)
            yield Window([micro], global_tokens=info.window_loss_tokens, global_samples=info.global_samples)
    finally:
        loader.close()


def batch_cost(batch: dict[str, Any]) -> tuple[int, int]:
    """(real tokens, cost tokens) of a micro-batch: padded rows x width, or a packed row's length."""
    if "attention_mask" in batch:
        rows, width = batch["input_ids"].shape
        return int(batch["attention_mask"].sum()), rows * width
    n = int(batch["input_ids"].numel())
    return n, n
