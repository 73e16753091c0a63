"""The arms' batching, each as a stream of optimizer-step *windows* on one rank.

A window is the list of micro-batches of one optimizer step plus the step's global supervised-token count (the
denominator of the exact per-token loss, and the input of the LR rule):

- ``hf_default``, ``group_by_length``: the dry run's plan ([`evenflow.demo.steps`][evenflow.demo.steps]), each rank's
  micro-batches through a ``DataLoader`` (``batch_sampler=`` the plan, ``PadCollate``: padded to the longest). The
  global token count takes one all_reduce per window over the whole window fetched ahead -- what HF's ``Trainer`` does
  for ``num_items_in_batch`` with ``average_tokens_across_devices``.
- ``trl_packing``: TRL's packs (``pack_dataset``, best fit decreasing) the same way, one per rank and step,
  collated by TRL's own padding-free ``DataCollatorForLanguageModeling`` (``position_ids`` restart per sequence,
  the first label of each masked). Through this loop, not ``SFTTrainer``: the loop is what every arm shares.
- ``evenflow`` / ``evenflow_summed``: [`evenflow.DynamicBatchLoader`][evenflow.DynamicBatchLoader] with its defaults,
  ``cost="padded"`` or ``"summed"`` (one packed row per batch, ``FlatCollate``), one batch per rank per step.

A rank with no micro-batch in a step (the last of an odd number of packs) backpropagates an IDLE placeholder, so
DDP's gradient all-reduce still meets on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..planning.loss import IGNORE_INDEX
from ..runtime import DynamicBatchLoader, PadCollate, pop_step_info
from .config import DemoConfig
from .plan import Matching
from .prepare import DemoData

__all__ = ["Window", "Micro", "arm_windows", "TrlPackCollate", "batch_cost", "PAD_ID"]

PAD_ID = 0
"""Dense id used for padding (the remap's unk); padded positions are labelled -100."""
LOADER_ARMS = ("evenflow", "evenflow_summed")


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


@dataclass(frozen=True)
class TrlPackCollate:
    """One TRL pack (its samples, in TRL's order) -> the row TRL's padding-free collator makes of it.

    The pack is handed to ``DataCollatorForLanguageModeling(padding_free=True)`` as ``pack_dataset`` leaves it:
    one example of concatenated ``input_ids`` and ``labels`` with its ``seq_lengths``. Kept: ``input_ids``,
    ``labels``, ``position_ids`` (the demo's loss takes no flash-attention kwargs; NOTE [ Packed attention on CPU ]
    in evenflow.demo.attention reads the restarts from the positions).
    """

    pad_token_id: int = PAD_ID

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        example = {"input_ids": torch.cat([s["input_ids"] for s in samples]).tolist(),
                   "labels": torch.cat([s["labels"] for s in samples]).tolist(),
                   "seq_lengths": [int(s["input_ids"].numel()) for s in samples]}
        out = DataCollatorForLanguageModeling(pad_token_id=self.pad_token_id, padding_free=True)([example])
        return {key: out[key] for key in ("input_ids", "labels", "position_ids")}


def arm_windows(arm: str, data: DemoData, config: DemoConfig, matching: Matching, rank: int) -> Iterator[Window]:
    if arm in LOADER_ARMS:
        return _evenflow_windows(data, config, cost="summed" if arm == "evenflow_summed" else "padded")
    collate = TrlPackCollate() if arm == "trl_packing" else PadCollate(pad_token_id=PAD_ID)
    return _planned_windows([step[rank] for step in matching.arms[arm].per_rank], data, config, collate)


def _idle() -> Micro:
    """A one-token placeholder whose loss is multiplied by 0: the rank joins the step's gradient all-reduce."""
    return Micro({"input_ids": torch.full((1, 1), PAD_ID), "labels": torch.full((1, 1), IGNORE_INDEX)}, idle=True)


def _planned_windows(mine: list[list[list[int]]], data: DemoData, config: DemoConfig, collate) -> Iterator[Window]:
    """``mine[s]`` = this rank's micro-batches at step s (sample-id lists), loaded by one ``DataLoader``."""
    loader = DataLoader(data.train, batch_sampler=[mb for step in mine for mb in step],
                        num_workers=config.num_workers, collate_fn=collate)
    batches = iter(loader)
    for step in mine:
        micros = [Micro(next(batches), samples=len(mb)) for mb in step] or [_idle()]
        local = sum(int((m.batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micros if not m.idle)
        counts = torch.tensor([local, sum(m.samples for m in micros)], dtype=torch.long)
        dist.all_reduce(counts)
        yield Window(micros, global_tokens=int(counts[0]), global_samples=int(counts[1]))
    next(batches, None)  # the exhausted iterator shuts its worker down now, not at garbage collection


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


def batch_cost(batch: Mapping[str, Any]) -> tuple[int, int]:
    """(real tokens, cost tokens) of a micro-batch: padded rows x width, or a packed row's length."""
    if "attention_mask" in batch:
        rows, width = batch["input_ids"].shape
        return int(batch["attention_mask"].sum()), rows * width
    n = int(batch["input_ids"].numel())
    return n, n
