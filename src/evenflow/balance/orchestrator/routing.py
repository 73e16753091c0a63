"""One rank's orders and split sizes, derived from the global :class:`StepPlan` (pure).

See NOTE [ Composed routing ] in :mod:`evenflow.balance.orchestrator`: encoder outputs go from the encoder
rank straight to the LLM rank of their example, all phases in one exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Everything one rank needs to run a step: orders, split sizes, row indices. Pure, from a :class:`StepPlan`."""

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


def _encoder_inputs(plan: StepPlan, rank: int) -> tuple[dict, dict, dict, dict, np.ndarray, list[int]]:
    """Input exchange per phase, and the send side of the output exchange (NOTE [ Composed routing ])."""
    W = plan.world
    in_send_items, in_send, in_recv, enc_rows = {}, {}, {}, {}
    out_blocks = []  # per phase: (LLM rank, start row in cat(outputs), rows) of each item encoded here
    phase_offset = 0
    out_send = np.zeros(W, dtype=np.int64)
    for p in plan.phases:
        it = plan.items[p]
        local = np.flatnonzero(plan.source[it.example] == rank)  # global ids; local index = position in `local`
        in_send_items[p] = np.argsort(it.dest[local], kind="stable").tolist()
        in_send[p] = _bincount(it.dest[local], it.rows[local], W)
        enc = np.flatnonzero(it.dest == rank)
        enc_rows[p] = it.rows[enc].tolist()
        in_recv[p] = _bincount(plan.source[it.example[enc]], it.rows[enc], W)
        llm_dest = plan.dest[it.example[enc]]
        out_blocks.append((llm_dest, _starts(it.out_rows[enc]) + phase_offset, it.out_rows[enc]))
        out_send += np.bincount(llm_dest, weights=it.out_rows[enc], minlength=W).astype(np.int64)
        phase_offset += int(it.out_rows[enc].sum())
    # Send buffer: for each destination d, for each phase, that phase's items bound for d (arrival order).
    parts = [_ranges(starts[dest == d], counts[dest == d]) for d in range(W) for dest, starts, counts in out_blocks]
    out_send_index = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return in_send_items, in_send, in_recv, enc_rows, out_send_index, out_send.tolist()


def _encoder_outputs(plan: StepPlan, rank: int, llm_ex: np.ndarray) -> tuple[dict, dict, list[int]]:
    """Receive side of the output exchange: where each phase's rows land, in (LLM example, item) order."""
    W = plan.world
    row = 0
    arrival = {p: ([], []) for p in plan.phases}  # per phase: item ids, their starting row in the buffer
    out_recv = np.zeros(W, dtype=np.int64)
    # Receive buffer: for each source v, for each phase, items (encoded on v, example trained here) by id.
    for v in range(W):
        for p in plan.phases:
            it = plan.items[p]
            ids = np.flatnonzero((it.dest == v) & (plan.dest[it.example] == rank))
            arrival[p][0].append(ids)
            arrival[p][1].append(row + _starts(it.out_rows[ids]))
            n_rows = int(it.out_rows[ids].sum())
            row += n_rows
            out_recv[v] += n_rows
    media_index, media_counts = {}, {}
    for p in plan.phases:
        it = plan.items[p]
        ids = np.concatenate(arrival[p][0]) if arrival[p][0] else np.zeros(0, np.int64)
        starts = np.concatenate(arrival[p][1]) if arrival[p][1] else np.zeros(0, np.int64)
        order = np.argsort(ids, kind="stable")  # global id order = (LLM example, item) order
        ids, starts = ids[order], starts[order]
        media_index[p] = _ranges(starts, it.out_rows[ids])
        per_example = np.bincount(np.searchsorted(llm_ex, it.example[ids]), weights=it.out_rows[ids],
                                  minlength=llm_ex.size).astype(np.int64) if ids.size else np.zeros(llm_ex.size, np.int64)
        media_counts[p] = per_example.tolist()
    return media_index, media_counts, out_recv.tolist()


def rank_routing(plan: StepPlan, rank: int) -> RankRouting:
    """Derive one rank's orders and split sizes from the global plan (NOTE [ Composed routing ])."""
    W = plan.world
    mine = np.flatnonzero(plan.source == rank)
    send_order = mine[np.argsort(plan.dest[mine], kind="stable")]
    llm_ex = np.flatnonzero(plan.dest == rank)
    in_send_items, in_send, in_recv, enc_rows, out_send_index, out_send = _encoder_inputs(plan, rank)
    media_index, media_counts, out_recv = _encoder_outputs(plan, rank, llm_ex)
    return RankRouting(rank=rank, text_send_positions=plan.position[send_order].tolist(),
                       text_send=_bincount(plan.dest[mine], plan.length[mine], W),
                       text_recv=_bincount(plan.source[llm_ex], plan.length[llm_ex], W), llm_examples=llm_ex,
                       llm_lengths=plan.length[llm_ex].tolist(), in_send_items=in_send_items, in_send=in_send,
                       in_recv=in_recv, enc_item_rows=enc_rows, out_send_index=out_send_index, out_send=out_send,
                       out_recv=out_recv, media_index=media_index, media_counts=media_counts)
