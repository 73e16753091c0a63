"""The loader on a device mesh: its data-parallel group, its CP/SP peers, and the peers' agreement check.

    mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    loader = DynamicBatchLoader(ds, token_budget=32768, cost="summed", mesh=mesh,
                                dp_dims=("dp_replicate", "dp_shard"), cp_dim="cp")

The loader plans over the ranks that differ only in the data-parallel dims (its metadata group); the ranks that
share those coordinates -- the CP/SP peers, and TP peers -- receive the same batch, which they then split
([`evenflow.shard_batch()`][evenflow.shard_batch]). Peers form their batches without talking (batches are a function of
the seed, the configuration, the data-parallel rank and size, and the data), and one small all-gather per batch over the
peers checks that they did: a peer handed another batch is refused on every rank, not trained on silently.

An accelerate ``ParallelismConfig`` (``parallelism_config=``) gives the same mesh: its sizes laid out in
accelerate's order (``dp_replicate, dp_shard, cp, sp, tp``, enabled dims only), as ``build_device_mesh`` does.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..errors import sample_of
from ..planning.loss import loss_scale
from ..planning.shard import ShardLayout
from ..step_info import STEP_INFO_KEY, StepInfo

__all__ = ["MeshPlacement", "PeerAgreement", "accelerate_mesh", "mesh_release", "rank_groups", "resolve_mesh",
           "shard_length_fn", "shard_lengths"]

# accelerate's canonical mesh order (ParallelismConfig._get_mesh) and its data-parallel dims.
_ACCELERATE_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")
_ACCELERATE_DP = ("dp_replicate", "dp_shard")


@dataclass(frozen=True)
class MeshPlacement:
    """Where this rank sits: its data-parallel group (the loader's) and its CP/SP peers (same batch)."""

    layout: ShardLayout | None
    """How a batch splits over the CP/SP dim (``None``: no CP/SP dim; peers are TP peers only)."""
    shard_rank: int
    """This rank's index along the CP/SP dim (0 without one)."""
    dp_ranks: tuple[int, ...]
    """Global ranks of this rank's data-parallel group (the loader's metadata group)."""
    peer_ranks: tuple[int, ...]
    """Global ranks that receive this rank's batch (its CP/SP and TP peers, itself included)."""
    dp_group: object = field(default=None, compare=False, repr=False)
    peer_group: object = field(default=None, compare=False, repr=False)

    @property
    def degree(self) -> int:
        """CP/SP ranks that split one batch (1 without a CP/SP dim)."""
        return self.layout.degree if self.layout is not None else 1


def accelerate_mesh(config: object) -> tuple[np.ndarray, tuple[str, ...]]:
    """The rank layout and dim names of an accelerate ``ParallelismConfig`` (feature-detected by its sizes)."""
    sizes = {}
    for name in _ACCELERATE_ORDER:
        value = getattr(config, f"{name}_size", None)
        if value is None and name == "sp":
            value = 1  # accelerate before sequence parallelism
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallelism_config has no usable {name}_size ({value!r}); pass an accelerate "
                             "ParallelismConfig, or the DeviceMesh itself with mesh=")
        sizes[name] = value
    names = tuple(n for n in _ACCELERATE_ORDER if sizes[n] > 1) or ("dp_shard",)
    shape = tuple(sizes[n] for n in names)
    return np.arange(int(np.prod(shape))).reshape(shape), names


def rank_groups(ranks: np.ndarray, names: Sequence[str], dims: Sequence[str]) -> list[list[int]]:
    """Global ranks of every group spanning ``dims`` (the other dims fixed), in one order on every rank.

    >>> rank_groups(np.arange(4).reshape(2, 2), ("dp", "cp"), ("dp",))
    [[0, 2], [1, 3]]
    """
    index = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in index]
    moved = np.transpose(ranks, rest + index)
    size = int(np.prod([ranks.shape[i] for i in index])) if index else 1
    return [[int(r) for r in row] for row in moved.reshape(-1, size).tolist()]


def _names(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if value is None:
        return ()
    return tuple(value)


def resolve_mesh(*, mesh: object, parallelism_config: object, dp_dims: object, cp_dim: str | None,
                 sp_dim: str | None, process_group: object, timeout: timedelta) -> MeshPlacement | None:
    """This rank's [`MeshPlacement`][MeshPlacement], its gloo groups created (collective), or ``None`` without a
    mesh."""
    if mesh is None and parallelism_config is None:
        if dp_dims is not None or cp_dim is not None or sp_dim is not None:
            raise ValueError("dp_dims=, cp_dim= and sp_dim= name dimensions of a mesh: pass mesh= (a DeviceMesh) or "
                             "parallelism_config= (accelerate's ParallelismConfig) too")
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("DynamicBatchLoader(mesh=...) needs torch.distributed initialized (init_process_group "
                           "first): it creates the loader's groups over the mesh")
    ranks, names = _layout(mesh, parallelism_config)
    if cp_dim is None and sp_dim is None and parallelism_config is not None:
        cp_dim = "cp" if "cp" in names else None
        sp_dim = "sp" if "sp" in names else None
    if cp_dim is not None and sp_dim is not None:
        raise ValueError(f"pass cp_dim= (ring attention) or sp_dim= (Ulysses), not both: got cp_dim={cp_dim!r}, "
                         f"sp_dim={sp_dim!r}; context and sequence parallelism are exclusive")
    dp = _names(dp_dims) or tuple(d for d in (("dp",) if "dp" in names else _ACCELERATE_DP) if d in names)
    shard_dim = cp_dim or sp_dim
    for d in dp + ((shard_dim,) if shard_dim else ()):
        if d not in names:
            raise ValueError(f"the mesh has no dimension {d!r} (its dims: {names}); name its data-parallel dims with "
                             "dp_dims= and its CP/SP dim with cp_dim= / sp_dim=")
    if shard_dim in dp:
        raise ValueError(f"{shard_dim!r} is named both a data-parallel dim and the CP/SP dim: CP/SP peers share a "
                         "batch, data-parallel peers do not")
    world = dist.get_world_size()
    if ranks.size != world:
        raise ValueError(f"the mesh has {ranks.size} ranks ({dict(zip(names, ranks.shape))}) but the job has {world}: "
                         "build the mesh (or ParallelismConfig) over every rank of the job")
    me = dist.get_rank()
    dp_groups = rank_groups(ranks, names, dp)
    peer_groups = rank_groups(ranks, names, [n for n in names if n not in dp])
    mine_dp = next(g for g in dp_groups if me in g)
    mine_peers = next(g for g in peer_groups if me in g)
    if process_group is not None:
        given = sorted(dist.get_process_group_ranks(process_group))
        if given != sorted(mine_dp):
            raise ValueError(f"evenflow: rank {me}: process_group= spans ranks {given} but the mesh's data-parallel "
                             f"dims {dp} put this rank's data-parallel group at {sorted(mine_dp)}; the loader plans "
                             "over its data-parallel group, so the two must agree. Drop process_group= (the loader "
                             "builds it from the mesh) or name the mesh's data-parallel dims with dp_dims=")
        dp_group = process_group
    else:
        dp_group, _ = dist.new_subgroups_by_enumeration(dp_groups, timeout=timeout, backend="gloo")
    peer_group = None  # groups of one (a mesh of data-parallel dims only) share nothing to check
    if len(peer_groups[0]) > 1:
        peer_group, _ = dist.new_subgroups_by_enumeration(peer_groups, timeout=timeout, backend="gloo")
    layout = None
    if shard_dim is not None:
        layout = ShardLayout("ring" if cp_dim else "ulysses", int(ranks.shape[names.index(shard_dim)]))
    coords = np.argwhere(ranks == me)[0]
    shard_rank = int(coords[names.index(shard_dim)]) if shard_dim else 0
    return MeshPlacement(layout=layout, shard_rank=shard_rank, dp_ranks=tuple(mine_dp), peer_ranks=tuple(mine_peers),
                         dp_group=dp_group, peer_group=peer_group)


def _layout(mesh: object, config: object) -> tuple[np.ndarray, tuple[str, ...]]:
    """The mesh's rank tensor and dim names; with both a mesh and a ParallelismConfig, they must agree."""
    from_config = accelerate_mesh(config) if config is not None else None
    if mesh is None:
        return from_config
    tensor, names = getattr(mesh, "mesh", None), getattr(mesh, "mesh_dim_names", None)
    if not isinstance(tensor, torch.Tensor) or not names:
        raise TypeError(f"mesh= must be a torch DeviceMesh with mesh_dim_names, got {type(mesh).__name__}")
    ranks, names = tensor.cpu().numpy(), tuple(names)
    if from_config is not None and (ranks.shape != from_config[0].shape or names != from_config[1]):
        raise ValueError(f"mesh= has dims {dict(zip(names, ranks.shape))} but parallelism_config= gives "
                         f"{dict(zip(from_config[1], from_config[0].shape))}; pass one of them")
    return ranks, names


class PeerAgreement:
    """One all-gather per batch over the CP/SP peers: every peer must hold the same batch (or the same end)."""

    def __init__(self, placement: MeshPlacement) -> None:
        self.placement = placement
        self.rank = dist.get_rank()

    def check(self, info: StepInfo | None, batch: object, epoch: int) -> ValueError | None:
        """The error every peer raises when the peers' batches differ (``info=None``: this peer's epoch ended)."""
        mine = _digest(info, batch, epoch)
        gathered = [torch.zeros_like(mine) for _ in self.placement.peer_ranks]
        dist.all_gather(gathered, mine, group=self.placement.peer_group)
        if all(torch.equal(g, gathered[0]) for g in gathered):
            return None
        where = ", ".join(f"rank {r}: {_describe(g)}" for r, g in zip(self.placement.peer_ranks, gathered))
        return ValueError(
            f"evenflow: rank {self.rank}: its CP/SP peers {list(self.placement.peer_ranks)} were handed different "
            f"batches at epoch {epoch}, step {info.step if info is not None else 'end'} ({where}; this rank's "
            f"samples {info.sample_ids[:8] if info is not None else []}); peers split one "
            "batch, so every peer must build its loader alike -- the same dataset (content and order), seed, "
            "token_budget and other arguments, and the same mesh. Build the dataset identically on every rank "
            "(not sharded by global rank: the loader shards by data-parallel rank itself)")


_END = -1


def _digest(info: StepInfo | None, batch: object, epoch: int) -> torch.Tensor:
    """``[epoch, step, samples, real tokens, loss tokens, crc of the sample ids, crc of input_ids]``."""
    if info is None:
        return torch.tensor([epoch, _END, 0, 0, 0, 0, 0], dtype=torch.int64)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    content = zlib.crc32(ids.detach().cpu().numpy().tobytes()) if isinstance(ids, torch.Tensor) else 0
    keys = zlib.crc32(repr([sample_of(k) if isinstance(k, tuple) else k for k in info.sample_ids]).encode())
    return torch.tensor([epoch, info.step, info.local_samples, info.real_tokens, info.local_loss_tokens, keys,
                         content], dtype=torch.int64)


def _describe(row: torch.Tensor) -> str:
    values = row.tolist()
    if values[1] == _END:
        return "epoch ended"
    return f"step {values[1]}, {values[2]} samples, {values[3]} tokens, input_ids crc {values[6]}"


def shard_length_fn(length_fn: Callable | None, layout: ShardLayout | None) -> Callable | None:
    """The planner's length of a sample under ring CP: its document padded to ``2 x cp`` (what it occupies)."""
    if layout is None or layout.style != "ring":
        return length_fn

    def padded(sample: Mapping) -> int:
        return layout.document_length(length_fn(sample) if length_fn is not None else len(sample["input_ids"]))

    return padded


def shard_lengths(lengths: object, layout: ShardLayout | None) -> object:
    """``lengths=`` as the planner sees them under ring CP: every document at its padded length (else as given)."""
    if lengths is None or layout is None or layout.style != "ring":
        return lengths

    def padded(values: object) -> list[int]:
        return (-(-np.asarray(values, dtype=np.int64) // layout.unit) * layout.unit).tolist()

    if isinstance(lengths, Mapping):
        return {k: padded(v) if k == "tokens" else v for k, v in lengths.items()}
    return padded(lengths)


def mesh_release(release, placement: MeshPlacement | None):
    """A released batch whose StepInfo counts the loss over DP x CP/SP (NOTE [ Loss scale ] in planning/loss.py).

    The collation thread knows its data-parallel group only; every CP/SP peer of a group holds the group's
    batch, and gradients are averaged over all DP x degree ranks, so the scale's rank count is that product
    while the token counts stay the group's (each token counted once, never once per peer).
    """
    if placement is None or placement.degree == 1:
        return release
    info = release.info
    ranks = info.world_size * placement.degree
    info = dataclasses.replace(info, shard_degree=placement.degree,
                               loss_scale=loss_scale(info.local_loss_tokens, info.window_loss_tokens, ranks))
    batch = release.batch
    if isinstance(batch, MutableMapping):
        batch[STEP_INFO_KEY] = info
    return dataclasses.replace(release, info=info)
