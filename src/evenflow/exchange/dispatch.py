"""The thin torch.distributed part of balancing: move samples or rows with one ``all_to_all_single``.

Everything else in [`evenflow.balance`][evenflow.balance] is pure planning; this module only packs, exchanges and
unpacks.

* [`exchange_samples()`][exchange_samples] -- dicts of tensors (any dtypes and shapes) to their destination ranks. Used
  at the loader level with CPU tensors over the gloo group, or with device tensors over any group.
* [`all_to_all_rows()`][all_to_all_rows] -- a differentiable exchange of the rows of one tensor; its backward is the
  inverse exchange (the received gradient rows go back to where the rows came from).

NOTE [ Every rank enters every collective ]
    A collective completes only when every rank of the group calls it, in the same order. So a rank with
    nothing to send still calls with zero-length splits, and a rank that receives nothing still passes an
    empty output. gloo's list-form ``all_to_all`` rejects uneven sizes, so each destination's tensors are
    packed into one byte buffer and the exchange is ``all_to_all_single`` with split sizes. For the
    differentiable exchange this extends to the backward pass: every rank must make its loss depend on the
    output (even an empty one, e.g. ``loss + 0 * out.sum()``), or that rank skips the backward collective
    and the others wait forever. Every call names its ``group``; keep balancing traffic off the group DDP
    uses for gradient buckets, whose collectives are issued in an order this module cannot see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

__all__ = ["exchange_samples", "pack_samples", "exchange_packed", "arrival_order", "all_to_all_rows", "exchange_counts",
           "AllToAllRows"]

ALIGN = 16
"""Byte alignment of every tensor inside a packed buffer, so each can be viewed back as its own dtype."""


def _group_info(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def arrival_order(dests_by_source: Sequence[Sequence[int]], rank: int) -> list[tuple[int, int]]:
    """Which ``(source rank, position)`` each sample received by ``rank`` comes from, in arrival order.

    [`exchange_samples()`][exchange_samples] delivers samples ordered by source rank, then by position at the source.
    Every rank can compute this from the (shared) plan without another exchange.

    >>> arrival_order([[1, 0, 1], [1]], 1)
    [(0, 0), (0, 2), (1, 0)]
    """
    return [(s, j) for s, dests in enumerate(dests_by_source) for j, d in enumerate(dests) if d == rank]


def exchange_counts(send_counts: Sequence[int], *, group: dist.ProcessGroup,
                    device: torch.device | str = "cpu") -> list[int]:
    """``recv[s]`` = what rank ``s`` sends to this rank, from every rank's ``send_counts`` (one collective)."""
    _, world = _group_info(group)
    if len(send_counts) != world:
        raise ValueError(f"send_counts has {len(send_counts)} entries for a group of {world} ranks")
    send = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
    recv = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"received an unknown dtype {name!r}; ranks may run different torch versions")
    return dtype


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def exchange_samples(samples: Sequence[Mapping[str, torch.Tensor]], dest: Sequence[int], *,
                     group: dist.ProcessGroup, device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Send ``samples[i]`` to rank ``dest[i]`` of ``group``; return what this rank receives.

    Samples are dicts of tensors (any dtype, shape, number of keys). The result is ordered by source rank,
    then by position at the source (`arrival_order()`). A rank may send and receive nothing; it still
    takes part (NOTE [ Every rank enters every collective ]). Two collectives: the byte counts, then one
    ``all_to_all_single`` of buffers that hold each destination's header (keys, dtypes, shapes; JSON) and
    data. ``device`` holds the buffers: ``"cpu"`` for gloo, the rank's GPU for NCCL. Received tensors are
    fresh copies (not views of the buffer) and carry no autograd history.
    """
    _, world = _group_info(group)
    return exchange_packed(pack_samples(samples, dest, world, device=device), group=group, device=device)


def pack_samples(samples: Sequence[Mapping[str, torch.Tensor]], dest: Sequence[int], world: int, *,
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """The first half of [`exchange_samples()`][exchange_samples]: one uint8 buffer per destination rank, exactly the
    bytes
    [`exchange_packed()`][exchange_packed] sends (a caller that counts the bytes it moves reads ``numel()``)."""
    per_dest = _per_destination(samples, dest, world)
    return [_pack(samples, per_dest[d], device) for d in range(world)]


def exchange_packed(chunks: Sequence[torch.Tensor], *, group: dist.ProcessGroup,
                    device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The second half of [`exchange_samples()`][exchange_samples]: send ``chunks[d]`` (from
    [`pack_samples()`][pack_samples]) to rank d."""
    rank, world = _group_info(group)
    if len(chunks) != world:
        raise ValueError(f"got {len(chunks)} buffers for a group of {world} ranks; pack one per rank")
    sizes = [c.numel() for c in chunks]
    recv_sizes = exchange_counts(sizes, group=group, device=device)
    send_buf = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=device)
    recv_buf = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv_buf, send_buf, recv_sizes, sizes, group=group)
    out: list[dict[str, torch.Tensor]] = []
    start = 0
    for s in range(world):
        out.extend(_unpack(recv_buf[start:start + recv_sizes[s]]))
        start += recv_sizes[s]
    return out


def _per_destination(samples: Sequence[Mapping[str, torch.Tensor]], dest: Sequence[int],
                     world: int) -> list[list[int]]:
    """Positions of the samples bound for each rank; every sample checked first (errors name it)."""
    if len(dest) != len(samples):
        raise ValueError(f"dest has {len(dest)} entries for {len(samples)} samples; pass one destination rank "
                         "per sample")
    per_dest: list[list[int]] = [[] for _ in range(world)]
    for i, (d, sample) in enumerate(zip(dest, samples)):
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < world:
            raise ValueError(f"sample {i}: destination {d!r} is not a rank of the group (0..{world - 1})")
        if not isinstance(sample, Mapping):
            raise ValueError(f"sample {i} is a {type(sample).__name__}, not a dict of tensors; collate it into "
                             "a dict of tensors before dispatch")
        for key, value in sample.items():
            if not isinstance(key, str):
                raise ValueError(f"sample {i}: key {key!r} is not a string; use string keys")
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"sample {i}: value of {key!r} is a {type(value).__name__}, not a tensor; wrap "
                                 "it with torch.tensor(...) in the dataset or collate")
        per_dest[d].append(i)
    return per_dest


def _pack(samples: Sequence[Mapping[str, torch.Tensor]], positions: list[int],
          device: torch.device | str) -> torch.Tensor:
    """One destination's buffer: int64 header length, JSON header (key, dtype, shape, offset), aligned data."""
    header, payload = [], []
    offset = 0
    for i in positions:
        entry = []
        for key, value in samples[i].items():
            raw = _as_bytes(value)
            entry.append([key, str(value.dtype).removeprefix("torch."), list(value.shape), offset])
            pad = -raw.numel() % ALIGN
            payload.append(raw.to(device))
            if pad:
                payload.append(torch.zeros(pad, dtype=torch.uint8, device=device))
            offset += raw.numel() + pad
        header.append(entry)
    head = json.dumps(header, separators=(",", ":")).encode()
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8) if head else torch.zeros(0, dtype=torch.uint8)
    head_pad = -(8 + head_t.numel()) % ALIGN
    length = torch.tensor([head_t.numel()], dtype=torch.int64).view(torch.uint8)
    return torch.cat([length.to(device), head_t.to(device),
                      torch.zeros(head_pad, dtype=torch.uint8, device=device)] + payload)


def _unpack(chunk: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """The samples of one source's buffer (the inverse of [`_pack()`][_pack]), as fresh tensors."""
    head_len = int(chunk[:8].cpu().view(torch.int64).item())
    header = json.loads(chunk[8:8 + head_len].cpu().numpy().tobytes().decode()) if head_len else []
    base = 8 + head_len + (-(8 + head_len) % ALIGN)
    out = []
    for entry in header:
        sample = {}
        for key, dtype_name, shape, offset in entry:
            dtype = _dtype_from_name(dtype_name)
            numel = 1
            for dim in shape:
                numel *= dim
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            raw = chunk[base + offset:base + offset + nbytes]
            sample[key] = raw.clone().view(dtype).reshape(shape) if dtype != torch.uint8 else raw.clone().reshape(shape)
        out.append(sample)
    return out


class AllToAllRows(torch.autograd.Function):
    """Rows of ``x`` grouped by destination -> rows grouped by source; backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        back = grad.new_empty((sum(ctx.send_counts),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_counts, ctx.recv_counts, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int] | None = None, *,
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable all-to-all of rows: the first ``send_counts[0]`` rows of ``x`` go to rank 0, and so on.

    Returns the received rows, grouped by source rank. ``recv_counts`` is usually known from the plan; when
    ``None`` it is exchanged first (one extra collective, not differentiable). The backward pass sends each
    gradient row back to the rank its row came from (NOTE [ Every rank enters every collective ]: every rank
    must use the output in its loss).
    """
    _, world = _group_info(group)
    send = [int(c) for c in send_counts]
    if len(send) != world or any(c < 0 for c in send):
        raise ValueError(f"send_counts must be {world} non-negative row counts, got {list(send_counts)}")
    if sum(send) != x.shape[0]:
        raise ValueError(f"send_counts sum to {sum(send)} rows but x has {x.shape[0]}; every row goes somewhere")
    recv = exchange_counts(send, group=group, device=x.device) if recv_counts is None else [int(c) for c in recv_counts]
    if len(recv) != world:
        raise ValueError(f"recv_counts must have {world} entries, got {len(recv)}")
    return AllToAllRows.apply(x, send, recv, group)
