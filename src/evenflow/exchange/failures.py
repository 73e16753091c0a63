"""How a failure on one rank reaches every rank inside an orchestrated step, in exchanges the step makes anyway.

NOTE [ Failures inside a step ]
    A rank that raises between two collectives of a step leaves its peers waiting in the next one until the
    process-group timeout. So a rank that fails keeps entering the step's collectives, with zeros shaped by the
    plan, and says so in the next exchange that can carry it; then every rank raises at the same point, before
    any backward pass (so no rank waits in the all-to-all backward either):

    - before any data moves (building its examples: a grid that does not match its rows, placeholders that do
      not match an item's output rows): in the metadata exchange, whose row holds a status word and then the
      failure's detail instead of the metadata ([`metadata_row()`][metadata_row]);
    - while moving or encoding (an encoder that raises): in the output exchange, whose chunk to every
      destination starts with [`header_rows()`][header_rows] status rows (the detail's bytes, one per value: exact in
      float16 and bfloat16), when ``OrchestratorConfig.output_dim`` says how wide they are; otherwise in one
      all_gather of the detail before the output exchange.

    The failing rank re-raises its own exception, with a note naming its rank; every other rank raises
    [`PeerError`][evenflow.PeerError] naming the first failing rank, the exception's type and message, and the
    dataset index of the sample when the failure names one ([`ExampleError`][ExampleError]).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import DETAIL_WIDTH, ExampleError, PeerError, decode_detail, encode_detail

__all__ = ["ExampleError", "detail_row", "header_count", "header_rows", "read_header", "raise_shared",
           "STATUS_OK", "STATUS_FAILED"]

STATUS_OK, STATUS_FAILED = 0, 1
DETAIL_BYTES = DETAIL_WIDTH * 8
"""Bytes of one failure report ([`evenflow.errors.encode_detail()`][evenflow.errors.encode_detail])."""


def detail_row(exc: BaseException | None) -> np.ndarray:
    """The int64 report of ``exc`` (all zeros for ``None``)."""
    return encode_detail(exc, getattr(exc, "sample_index", None))


def header_count(width: int) -> int:
    """Status rows of ``width`` values that hold one report: ``ceil(DETAIL_BYTES / width)``."""
    return math.ceil(DETAIL_BYTES / width)


def header_rows(exc: BaseException | None, width: int, *, dtype: torch.dtype, device: torch.device | str
                ) -> torch.Tensor:
    """``[header_count(width), width]`` status rows: the report's bytes as values 0..255, zero-padded."""
    raw = np.zeros(header_count(width) * width, dtype=np.float64)
    raw[:DETAIL_BYTES] = np.ascontiguousarray(detail_row(exc)).view(np.uint8)
    return torch.from_numpy(raw).to(device=device, dtype=dtype).reshape(-1, width)


def read_header(rows: torch.Tensor) -> np.ndarray:
    """The int64 report held by status rows from [`header_rows()`][header_rows]."""
    values = rows.detach().reshape(-1)[:DETAIL_BYTES].to(torch.float64).cpu().numpy()
    return np.rint(values).astype(np.uint8).view(np.int64)


def raise_shared(rows: np.ndarray, own: BaseException | None, *, rank: int, where: str) -> None:
    """Raise on every rank when any row reports a failure: ``own`` on the rank that failed (with a note),
    [`PeerError`][evenflow.PeerError] naming the first failing rank on every other. ``rows``: one report per rank."""
    if own is not None:
        if hasattr(own, "add_note"):
            own.add_note(f"evenflow: raised on rank {rank} {where}; every other rank raises PeerError there")
        raise own
    failed = [r for r in range(rows.shape[0]) if rows[r].any()]
    if failed:
        name, message, sample = decode_detail(rows[failed[0]])
        raise PeerError(failed[0], name, f"{message} ({where})", sample, this_rank=rank)
