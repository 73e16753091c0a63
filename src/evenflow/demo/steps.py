"""Which samples each optimizer step of an arm holds, on which rank: the one definition the demo trains and
``benchmarks/quality_replay.py`` replays, so a stored replay row and the demo's arm of the same seed are the same
steps ([`schedule_fingerprint()`][schedule_fingerprint] checks it).

Every function is pure (lengths, seed, sizes -> sample ids); none touches a model or ``torch.distributed``.

- [`matched_random_steps()`][matched_random_steps] -- HF ``Trainer``'s default: a seeded random order, padded
  micro-batches of ``batch_size`` samples, the epoch split into exactly evenflow's number of optimizer steps (the
  replay's ``fixed_matched``). HF's ``gradient_accumulation_steps`` is an integer: with 1,000 chats, batch 1 per rank
  and 2 ranks, 4 gives 125 steps and 5 gives 100 against evenflow's 117, so the split takes 4 or 5 micro-batches per
  rank (8 or 9 samples a step) to land on 117 exactly -- the comparison is at the same number of updates.
- [`length_grouped_steps()`][length_grouped_steps] -- ``TrainingArguments(group_by_length=True)``: HF's own
  ``get_length_grouped_indices`` (megabatches of 50 x batch x accumulation, each sorted longest first), split the
  same way.
- [`trl_packs()`][trl_packs] / [`pack_steps()`][pack_steps] -- TRL's packing:
  ``trl.data_utils.pack_dataset(strategy="bfd")`` (best fit decreasing into rows of ``token_budget`` tokens), the packs
  in a seeded random order (``Trainer``'s sampler), one pack per rank and optimizer step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["StepPlan", "matched_random_steps", "length_grouped_steps", "deal", "largest_batch_size",
           "hf_accumulation", "trl_packs", "pack_steps", "schedule_fingerprint", "peak_tokens"]

StepPlan = list[list[list[list[int]]]]
"""``plan[s][r]`` = rank r's micro-batches at optimizer step s, each a list of sample ids (``[]``: nothing, the
rank backpropagates an IDLE placeholder)."""


def matched_random_steps(num_samples: int, num_steps: int, seed: int) -> list[np.ndarray]:
    """A seeded random order of the epoch cut into ``num_steps`` consecutive steps (sizes differ by one at most).

    >>> [s.tolist() for s in matched_random_steps(5, 2, seed=0)]
    [[2, 4, 3], [0, 1]]
    """
    return np.array_split(np.random.default_rng(seed).permutation(num_samples), num_steps)


def length_grouped_steps(lengths: np.ndarray, num_steps: int, group_size: int, seed: int) -> list[np.ndarray]:
    """HF's length-grouped order (``group_size`` = per-device batch x accumulation, as ``Trainer`` passes it to
    ``LengthGroupedSampler``) cut into ``num_steps`` consecutive steps."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    order = get_length_grouped_indices([int(x) for x in lengths], group_size,
                                       generator=torch.Generator().manual_seed(seed))
    return np.array_split(np.asarray(order, dtype=np.int64), num_steps)


def deal(steps: Sequence[np.ndarray], batch_size: int, world_size: int) -> StepPlan:
    """Each step's samples in micro-batches of ``batch_size``, dealt round-robin to the ranks (accelerate's
    ``BatchSamplerShard``: batch k of a step goes to rank k mod W).

    >>> deal([np.array([5, 6, 7])], batch_size=1, world_size=2)
    [[[[5], [7]], [[6]]]]
    """
    plan: StepPlan = []
    for step in steps:
        ids = [int(i) for i in step]
        micro = [ids[k:k + batch_size] for k in range(0, len(ids), batch_size)]
        plan.append([micro[r::world_size] for r in range(world_size)])
    return plan


def peak_tokens(plan: StepPlan, lengths: np.ndarray, layout: str = "padded") -> int:
    """Largest micro-batch of the plan in tokens: rows x longest (``"padded"``) or the packed row's sum."""
    peak = 0
    for step in plan:
        for rank in step:
            for mb in rank:
                if mb:
                    cost = (len(mb) * int(lengths[mb].max()) if layout == "padded" else int(lengths[mb].sum()))
                    peak = max(peak, cost)
    return peak


def largest_batch_size(lengths: np.ndarray, num_steps: int, *, token_budget: int, world_size: int, seed: int) -> int:
    """The largest per-rank batch size whose epoch of random batches ([`matched_random_steps()`][matched_random_steps],
    dealt) never pads a micro-batch past ``token_budget``: what a user finds by trying batch sizes until the epoch
    fits."""
    steps = matched_random_steps(len(lengths), num_steps, seed)
    batch = 1
    while batch < len(lengths) and peak_tokens(deal(steps, batch + 1, world_size), lengths) <= token_budget:
        batch += 1
    return batch


def hf_accumulation(num_samples: int, num_steps: int, batch_size: int, world_size: int) -> int:
    """The integer ``gradient_accumulation_steps`` nearest to evenflow's samples per step (what a user sets)."""
    return max(1, round(num_samples / num_steps / (batch_size * world_size)))


def trl_packs(lengths: np.ndarray, seq_length: int) -> list[list[int]]:
    """TRL's best-fit-decreasing packs of the epoch, as sample ids in each pack's order.

    Runs ``trl.data_utils.pack_dataset`` itself on a stand-in column whose tokens are the sample's id (packing
    looks only at lengths), so the packs are TRL's to the sample. A sample longer than ``seq_length`` would be
    truncated by TRL; the demo's cutoff never exceeds its budget.
    """
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    if int(np.max(lengths)) > seq_length:
        raise ValueError(f"a sample of {int(np.max(lengths))} tokens exceeds seq_length={seq_length}: TRL's bfd "
                         "would truncate it; raise the budget or lower the cutoff")
    from datasets.utils import logging as datasets_logging

    stand_in = Dataset.from_dict({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
    shown = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()  # a "Map: 100%" bar per call would clutter the demo's output
    try:
        packed = pack_dataset(stand_in, seq_length, strategy="bfd")
    finally:
        if shown:
            datasets_logging.enable_progress_bar()
    packs = []
    for row in packed:
        starts = np.concatenate([[0], np.cumsum(row["seq_lengths"])[:-1]]).astype(int)
        packs.append([int(row["input_ids"][s]) for s in starts])
    return packs


def pack_steps(packs: Sequence[Sequence[int]], world_size: int, seed: int) -> StepPlan:
    """The packs in a seeded random order (``Trainer``'s ``RandomSampler``), one per rank and optimizer step; a
    last step with fewer packs than ranks leaves the rest IDLE."""
    import torch

    order = torch.randperm(len(packs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [[[list(packs[order[s + r]])] if s + r < len(order) else [] for r in range(world_size)]
            for s in range(0, len(order), world_size)]


def schedule_fingerprint(steps: Sequence[Sequence[int]]) -> str:
    """12 hex digits naming which samples each optimizer step holds, in step order (not how a step is split into
    micro-batches or ranks: the exact loss does not depend on it). The replay stores it in each row; the demo
    compares its own arm's with the row of its seed."""
    text = ";".join(",".join(str(i) for i in sorted(int(x) for x in step)) for step in steps)
    return hashlib.sha1(text.encode()).hexdigest()[:12]
