"""The one module that talks to torch.distributed for the loader's metadata.

Rank, world size and the gloo group are resolved once here, on the constructing thread, and then passed
around as plain values. Every collective names its group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Topology", "resolve_topology", "MetadataExchange"]


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    group: object | None
    """The gloo process group for metadata (None when world_size == 1 and no group was given)."""


def resolve_topology(process_group: object | None, timeout: timedelta) -> Topology:
    """Resolve rank, world size and the metadata group. Collective when it creates a group.

    Constructing a loader in a distributed job therefore must happen on every rank, in the same order
    (like any ``new_group``). A passed ``process_group`` is used as is; it must support CPU tensors (gloo).
    """
    if process_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("process_group was given but torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")
        return Topology(dist.get_rank(process_group), dist.get_world_size(process_group), process_group)
    if not dist.is_available() or not dist.is_initialized():
        return Topology(0, 1, None)
    if dist.get_world_size() == 1:
        return Topology(0, 1, None)
    # A dedicated gloo group: metadata stays on CPU and off the training (NCCL) group, and a timeout bounds
    # every wait (new_group's default would wait 30 minutes).
    group = dist.new_group(backend="gloo", timeout=timeout)
    return Topology(dist.get_rank(group), dist.get_world_size(group), group)


class MetadataExchange:
    """Fixed-size int64 all_gather over the metadata group (identity when world_size == 1)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def all_gather(self, row: np.ndarray) -> np.ndarray:
        """``row`` (1-D int64, same size on every rank) -> ``[world_size, size]``."""
        row = np.ascontiguousarray(row, dtype=np.int64)
        if self.topology.world_size == 1:
            return row[None].copy()
        send = torch.from_numpy(row)
        out = [torch.empty_like(send) for _ in range(self.topology.world_size)]
        try:
            dist.all_gather(out, send, group=self.topology.group)
        except Exception as exc:  # gloo raises RuntimeError/DistBackendError on timeouts and dead peers
            raise RuntimeError(
                f"evenflow: rank {self.topology.rank}'s metadata exchange failed ({type(exc).__name__}: {exc}). "
                "A peer rank most likely died, stopped iterating its loader, or built a different loader; "
                "check the other ranks' logs (the failing rank prints its own error)") from exc
        return torch.stack(out).numpy()
