"""Split one shard-ready batch for this CP/SP rank, and put the pieces back together.

    batch = next(it)                                   # the data-parallel group's whole batch, on every peer
    info = evenflow.pop_step_info(batch)
    mine = evenflow.shard_batch(batch, loader.mesh)    # this rank's tokens (NOTE [ Shard-ready rows ])

Token-aligned keys (``input_ids``, ``labels``, ``shift_labels``, ``position_ids`` -- any number of leading rows,
so Qwen2-VL's ``[4, 1, N]`` M-RoPE positions survive --, ``attention_mask``, ``mm_token_type_ids``,
``token_type_ids``, and ``inputs_embeds`` along its dim 1) are indexed with
[`evenflow.planning.shard.shard_token_indices()`][evenflow.planning.shard.shard_token_indices]; every other key
(``cu_seqlens_*``, ``use_cache``, images) is passed on whole, so each shard still says how the whole row is laid out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..planning.shard import ShardLayout, ShardStyle, shard_token_indices

__all__ = ["SEQUENCE_KEYS", "shard_batch", "unshard_batch", "shard_indices_of"]

SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "mm_token_type_ids",
                 "token_type_ids", "inputs_embeds")
"""Keys split along the sequence: the last dim, except ``inputs_embeds`` (``[rows, tokens, hidden]``: dim 1)."""


def _seq_dim(key: str) -> int:
    return 1 if key == "inputs_embeds" else -1


def _placement(mesh: object, style: ShardStyle | None, dim: str | None, rank: int | None) -> tuple[ShardLayout, int]:
    """``(layout, this rank's index in its CP/SP group)`` from the loader's ``mesh`` placement, a ``DeviceMesh``
    and the name of its CP/SP dimension, or a plain degree with ``rank=``."""
    layout = getattr(mesh, "layout", None)
    if isinstance(layout, ShardLayout):  # the loader's MeshPlacement
        if style is not None and style != layout.style:
            raise ValueError(f"shard_batch(style={style!r}) but the loader's mesh shards {layout.style!r}")
        return layout, mesh.shard_rank if rank is None else rank
    if style is None:
        raise ValueError("shard_batch needs style='ring' (context parallelism) or 'ulysses' (sequence parallelism) "
                         "unless it is given the loader's mesh (loader.mesh)")
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if rank is None:
            raise ValueError("shard_batch(batch, degree, style=...) needs rank= (this rank's index in its CP/SP group)")
        return ShardLayout(style, mesh), rank
    if callable(getattr(mesh, "get_local_rank", None)):  # a torch DeviceMesh
        dim = dim or ("cp" if style == "ring" else "sp")
        names = tuple(mesh.mesh_dim_names or ())
        if dim not in names:
            raise ValueError(f"the mesh has no dimension {dim!r} (names: {names}); pass dim= naming its CP/SP "
                             "dimension")
        index = names.index(dim)
        return ShardLayout(style, int(mesh.size(index))), int(mesh.get_local_rank(dim)) if rank is None else rank
    raise TypeError(f"shard_batch(batch, mesh): mesh must be the loader's `loader.mesh`, a DeviceMesh (with dim=) or "
                    f"the CP/SP degree (with rank=), got {type(mesh).__name__}")


def _segments(batch: Mapping, length: int) -> list[int]:
    """The row's segments: ``cu_seqlens_padded`` (or ``cu_seq_lens_q``) of a packed row, else the whole row."""
    for key in ("cu_seqlens_padded", "cu_seq_lens_q"):
        cu = batch.get(key)
        if isinstance(cu, torch.Tensor) and cu.numel() >= 2 and int(cu[-1]) == length:
            return torch.diff(cu.to(torch.long)).tolist()
    return [length]


def _length(batch: Mapping) -> int:
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if not isinstance(ids, torch.Tensor):
        raise ValueError("shard_batch needs a batch with 'input_ids' (or 'inputs_embeds') as a tensor")
    return int(ids.shape[1])


def shard_indices_of(batch: Mapping, layout: ShardLayout, rank: int) -> torch.Tensor:
    """The row positions CP/SP rank ``rank`` holds of ``batch`` (int64, in shard order)."""
    length = _length(batch)
    return torch.from_numpy(shard_token_indices(_segments(batch, length), layout, rank))


def shard_batch(batch: Mapping, mesh: object, *, style: ShardStyle | None = None, dim: str | None = None,
                rank: int | None = None) -> dict:
    """This CP/SP rank's shard of a shard-ready batch (NOTE [ Shard-ready rows ] in evenflow.planning.shard).

    ``mesh``: the loader's ``loader.mesh`` (style and rank known), a ``DeviceMesh`` with ``style=`` (and
    ``dim=``, default ``"cp"`` for ring and ``"sp"`` for Ulysses), or the CP/SP degree with ``style=`` and
    ``rank=``. ``"ring"`` takes chunks r and 2C-1-r of every segment (Megatron's THD split; torch's head-tail
    balancer for a one-segment row), ``"ulysses"`` the r-th contiguous slice. Train on ``shift_labels``.
    """
    layout, index = _placement(mesh, style, dim, rank)
    take = shard_indices_of(batch, layout, index)
    out = {}
    for key, value in batch.items():
        if key in SEQUENCE_KEYS and isinstance(value, torch.Tensor):
            out[key] = value.index_select(_seq_dim(key) % value.ndim, take.to(value.device))
        else:
            out[key] = value
    return out


def unshard_batch(shards: Sequence[Mapping], *, style: ShardStyle) -> dict:
    """The whole batch from every CP/SP rank's shard (rank order): the inverse of [`shard_batch()`][shard_batch].

    A per-token output laid out ``[rows, tokens, ...]`` (hidden states, logits) comes back in row order when
    passed under the key ``"inputs_embeds"``.
    """
    if not shards:
        raise ValueError("unshard_batch needs every CP/SP rank's shard, got none")
    layout = ShardLayout(style, len(shards))
    first = shards[0]
    pieces = {key: [s[key] for s in shards] for key in first if key in SEQUENCE_KEYS
              and isinstance(first[key], torch.Tensor)}
    any_key = next(iter(pieces), None)
    if any_key is None:
        raise ValueError("unshard_batch: the shards hold no token-aligned tensor")
    dim = _seq_dim(any_key) % first[any_key].ndim
    length = sum(int(s[any_key].shape[dim]) for s in shards)
    segments = _segments(first, length)
    orders = [torch.from_numpy(shard_token_indices(segments, layout, r)) for r in range(len(shards))]
    out = dict(first)
    for key, parts in pieces.items():
        d = _seq_dim(key) % parts[0].ndim
        whole = torch.cat(parts, dim=d)
        inverse = torch.empty(length, dtype=torch.long)
        inverse[torch.cat(orders)] = torch.arange(length)
        out[key] = whole.index_select(d, inverse.to(whole.device))
    return out
