"""Shard-ready layouts for context- and sequence-parallel groups: which tokens each CP/SP rank holds. Pure.

NOTE [ Shard-ready rows ]
    A context-parallel (ring) or sequence-parallel (Ulysses) group splits *one* batch along the sequence, so the
    data layer must hand every peer the same batch in a layout that splits without loss:

    * ring (``style="ring"``, degree C): every segment of the packed row -- a document with its own padding --
      is a multiple of ``2 C`` tokens and is cut into ``2 C`` equal chunks; rank r holds chunks r and
      ``2 C - 1 - r`` of every segment (Megatron's THD split; for a row that is one segment it is torch's
      head-tail load balancer). A causal mask then gives every rank the same work: the cheap head of a document
      pairs with its expensive tail. A document padded to any other multiple (TransformerEngine #1930) leaves
      chunks of unequal size.
    * Ulysses (``style="ulysses"``, degree S): the row is a multiple of S and rank r holds its r-th contiguous
      slice; the all-to-all over heads gathers the whole sequence inside attention, so documents need no padding.

    Labels are shifted *before* the split (``shift_labels``, -100 on every document's last token and on all
    padding): a shard predicts its own tokens' successors without looking across a shard boundary, where a
    shift inside the model would lose one label per boundary. Padding is never a loss token, so the loader's
    supervised-token count (``LossTokenRule``) is the sum of the shards' counts. The token budget is stated
    per data-parallel group (the whole row, before the split), and must divide by the unit (``2 C`` or S).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["SHARD_STYLES", "ShardLayout", "ShardStyle", "shard_token_indices"]

ShardStyle = Literal["ring", "ulysses"]
SHARD_STYLES = ("ring", "ulysses")


@dataclass(frozen=True)
class ShardLayout:
    """How one data-parallel group's batch is split over its ``degree`` CP (``"ring"``) or SP (``"ulysses"``) ranks."""

    style: ShardStyle
    degree: int

    def __post_init__(self) -> None:
        if self.style not in SHARD_STYLES:
            raise ValueError(f"shard style must be 'ring' (context parallelism) or 'ulysses' (sequence parallelism), "
                             f"got {self.style!r}")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise ValueError(f"the CP/SP degree must be a positive int, got {self.degree!r}")

    @property
    def unit(self) -> int:
        """Tokens every segment (ring) or the row (Ulysses) is a multiple of: ``2 x CP`` or ``SP``."""
        return 2 * self.degree if self.style == "ring" else self.degree

    def document_length(self, length: int) -> int:
        """A document's length in the packed row: rounded up to ``2 x CP`` (ring), unchanged (Ulysses)."""
        if self.style != "ring":
            return int(length)
        return -(-int(length) // self.unit) * self.unit

    def row_length(self, total: int) -> int:
        """The packed row's length for ``total`` tokens of (already padded) documents: a multiple of the unit."""
        return -(-int(total) // self.unit) * self.unit

    def check_budget(self, token_budget: int) -> None:
        """A budget every full row fits after padding: a multiple of the unit (refused otherwise)."""
        if token_budget % self.unit:
            lower = token_budget // self.unit * self.unit
            raise ValueError(
                f"token_budget={token_budget} is not a multiple of {self.unit} "
                f"({'2 x cp' if self.style == 'ring' else 'sp'} = {self.unit}): the budget is stated per "
                f"data-parallel group and every {'document' if self.style == 'ring' else 'row'} is padded to a "
                f"multiple of {self.unit} before the {self.degree} {'CP' if self.style == 'ring' else 'SP'} ranks "
                f"split it, so a row could outgrow it. Use token_budget={lower or self.unit} or "
                f"{lower + self.unit}")


def shard_token_indices(segments: Sequence[int], layout: ShardLayout, rank: int) -> np.ndarray:
    """Positions of the packed row that CP/SP rank ``rank`` holds, in its shard's order.

    ``segments``: the row's segment lengths (documents with their padding, then any tail padding), summing to
    the row. Ring, degree 2, one segment of 8: rank 0 holds ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.

    >>> shard_token_indices([8, 4], ShardLayout("ring", 2), 0).tolist()
    [0, 1, 6, 7, 8, 11]
    >>> shard_token_indices([5, 3], ShardLayout("ulysses", 2), 1).tolist()
    [4, 5, 6, 7]
    """
    if not 0 <= rank < layout.degree:
        raise ValueError(f"rank {rank} out of range for {layout.degree} {layout.style} ranks")
    lengths = np.asarray(segments, dtype=np.int64)
    total = int(lengths.sum())
    if layout.style == "ulysses":
        if total % layout.degree:
            raise ValueError(f"a row of {total} tokens does not split over {layout.degree} SP ranks: pad the row to a "
                             f"multiple of {layout.degree} (the loader's shard-ready collate does)")
        size = total // layout.degree
        return np.arange(rank * size, (rank + 1) * size, dtype=np.int64)
    bad = [int(n) for n in lengths if n % layout.unit]
    if bad:
        raise ValueError(f"segments of {bad} tokens do not split into {layout.unit} equal chunks (2 x cp): pad every "
                         f"document to a multiple of {layout.unit} (the loader's shard-ready collate does)")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    chunk = lengths // layout.unit
    parts = []
    for start, size in zip(starts.tolist(), chunk.tolist()):
        for c in (rank, layout.unit - 1 - rank):
            parts.append(np.arange(start + c * size, start + (c + 1) * size, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
