"""One rank's orders and split sizes, derived from the global [`StepPlan`][StepPlan] (pure).

See NOTE [ Composed routing ] in [`evenflow.exchange`][evenflow.exchange]: encoder outputs go from the encoder
rank straight to the LLM rank of their example, all phases in one exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .plan import StepPlan

__all__ = ["RankRouting", "rank_routing"]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + c)``: ``_ranges([5, 0], [2, 3])`` -> ``[5, 6, 0, 1, 2]``."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return np.arange(total, dtype=np.int64) + offsets


def _starts(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64) if len(counts) else np.zeros(0, np.int64)


def _bincount(index: np.ndarray, weights: np.ndarray, world: int) -> list[int]:
    return np.bincount(index, weights=weights, minlength=world).astype(np.int64).tolist()


@dataclass(frozen=True)
class RankRouting:
    """Everything one rank needs to run a step: orders, split sizes, row indices. Pure, from a
    [`StepPlan`][StepPlan]."""

    rank: int
    text_send_positions: list[int]
    """Local example positions in send order (by LLM rank)."""
    text_send: list[int]
    text_recv: list[int]
    """Tokens to / from each rank."""
    llm_examples: np.ndarray
    """Global ids of the examples this rank trains, in order."""
    llm_lengths: list[int]
    in_send_items: dict[str, list[int]]
    """Per phase, local item indices (flattened over local examples) in send order."""
    in_send: dict[str, list[int]]
    in_recv: dict[str, list[int]]
    enc_item_rows: dict[str, list[int]]
    """Per phase, input rows of each item this rank encodes, in arrival order."""
    out_send_index: np.ndarray
    """Rows of ``cat(encoder outputs over phases)`` in send order."""
    out_send: list[int]
    out_recv: list[int]
    media_index: dict[str, np.ndarray]
    """Per phase, rows of the received buffer in (LLM example, item) order."""
    media_counts: dict[str, list[int]]
    """Per phase, output rows per LLM example."""
    enc_item_meta: dict[str, np.ndarray] = field(default_factory=dict)
    """Per phase, ``[items, meta_width]`` metadata of each item this rank encodes, in arrival order."""
    llm_items: dict[str, np.ndarray] = field(default_factory=dict)
    """Per phase, global ids of the items whose outputs this rank's LLM examples consume, in (example, item)
    order: the order of ``media_index``."""


def _encoder_inputs(plan: StepPlan, rank: int) -> tuple[dict, dict, dict, dict, dict, np.ndarray, list[int]]:
    """Input exchange per phase, and the send side of the output exchange (NOTE [ Composed routing ])."""
    W = plan.world
    in_send_items, in_send, in_recv, enc_rows, enc_meta = {}, {}, {}, {}, {}
    # Per item encoded here, over all phases: its LLM rank, phase, arrival position, start row in cat(outputs)
    # and output rows. The send buffer holds, for each destination d and each phase, that phase's items bound
    # for d in arrival order: one lexsort, no loop over ranks (2,560 of them at scale).
    blocks: list[tuple[np.ndarray, ...]] = []
    phase_offset = 0
    for pi, p in enumerate(plan.phases):
        it = plan.items[p]
        local = np.flatnonzero(plan.source[it.example] == rank)  # global ids; local index = position in `local`
        in_send_items[p] = np.argsort(it.dest[local], kind="stable").tolist()
        in_send[p] = _bincount(it.dest[local], it.rows[local], W)
        enc = np.flatnonzero(it.dest == rank)  # arrival order: by source rank, then as sent = global id order
        enc_rows[p] = it.rows[enc].tolist()
        enc_meta[p] = it.meta[enc] if it.meta.shape[0] == it.rows.shape[0] else np.zeros((enc.size, 0), np.int64)
        in_recv[p] = _bincount(plan.source[it.example[enc]], it.rows[enc], W)
        out = it.out_rows[enc]
        blocks.append((plan.dest[it.example[enc]], np.full(enc.size, pi), np.arange(enc.size),
                       _starts(out) + phase_offset, out))
        phase_offset += int(out.sum())
    llm_dest, phase, pos, starts, counts = (np.concatenate(parts) for parts in zip(*blocks)) if blocks else \
        (np.zeros(0, np.int64),) * 5
    order = np.lexsort((pos, phase, llm_dest))
    out_send = np.bincount(llm_dest, weights=counts, minlength=W).astype(np.int64).tolist()
    return in_send_items, in_send, in_recv, enc_rows, enc_meta, _ranges(starts[order], counts[order]), out_send


def _encoder_outputs(plan: StepPlan, rank: int, llm_ex: np.ndarray) -> tuple[dict, dict, list[int], dict]:
    """Receive side of the output exchange: where each phase's rows land, in (LLM example, item) order.

    The buffer holds, for each encoder rank v, for each phase, the items (encoded on v, example trained here)
    by global id; one lexsort over the items trained here gives every item's starting row."""
    W = plan.world
    consumed = {p: np.flatnonzero(plan.dest[plan.items[p].example] == rank) for p in plan.phases}  # id order
    v = np.concatenate([plan.items[p].dest[ids] for p, ids in consumed.items()]) if consumed else np.zeros(0, np.int64)
    phase = np.concatenate([np.full(ids.size, pi) for pi, ids in enumerate(consumed.values())]) if consumed \
        else np.zeros(0, np.int64)
    ident = np.concatenate(list(consumed.values())) if consumed else np.zeros(0, np.int64)
    rows = np.concatenate([plan.items[p].out_rows[ids] for p, ids in consumed.items()]) if consumed \
        else np.zeros(0, np.int64)
    order = np.lexsort((ident, phase, v))
    start = np.empty(rows.size, dtype=np.int64)
    start[order] = _starts(rows[order])
    out_recv = np.bincount(v, weights=rows, minlength=W).astype(np.int64).tolist()
    media_index, media_counts, llm_items = {}, {}, {}
    at = 0
    for p, ids in consumed.items():
        it = plan.items[p]
        llm_items[p] = ids
        media_index[p] = _ranges(start[at:at + ids.size], it.out_rows[ids])
        at += ids.size
        per_example = (np.bincount(np.searchsorted(llm_ex, it.example[ids]), weights=it.out_rows[ids],
                                   minlength=llm_ex.size).astype(np.int64) if ids.size
                       else np.zeros(llm_ex.size, np.int64))
        media_counts[p] = per_example.tolist()
    return media_index, media_counts, out_recv, llm_items


def rank_routing(plan: StepPlan, rank: int) -> RankRouting:
    """Derive one rank's orders and split sizes from the global plan (NOTE [ Composed routing ])."""
    W = plan.world
    mine = np.flatnonzero(plan.source == rank)
    send_order = mine[np.argsort(plan.dest[mine], kind="stable")]
    llm_ex = np.flatnonzero(plan.dest == rank)
    in_send_items, in_send, in_recv, enc_rows, enc_meta, out_send_index, out_send = _encoder_inputs(plan, rank)
    media_index, media_counts, out_recv, llm_items = _encoder_outputs(plan, rank, llm_ex)
    return RankRouting(rank=rank, text_send_positions=plan.position[send_order].tolist(),
                       text_send=_bincount(plan.dest[mine], plan.length[mine], W),
                       text_recv=_bincount(plan.source[llm_ex], plan.length[llm_ex], W), llm_examples=llm_ex,
                       llm_lengths=plan.length[llm_ex].tolist(), in_send_items=in_send_items, in_send=in_send,
                       in_recv=in_recv, enc_item_rows=enc_rows, out_send_index=out_send_index, out_send=out_send,
                       out_recv=out_recv, media_index=media_index, media_counts=media_counts,
                       enc_item_meta=enc_meta, llm_items=llm_items)
