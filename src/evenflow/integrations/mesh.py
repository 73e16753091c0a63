"""The loader's metadata group over the data-parallel dimension of a ``DeviceMesh``.

With tensor/context parallelism, only data-parallel peers see different data; TP/CP peers must receive *identical*
batches. Give the loader a gloo group that spans exactly one data-parallel dimension: every TP/CP peer then holds
the same data-parallel rank in a group of the same size, and since batches are a deterministic function of
(seed, configuration, data-parallel rank and size, data), the peers form the same batches without talking.

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
    group = dp_process_group(mesh, "dp")          # collective: every rank calls it
    loader = DynamicBatchLoader(ds, token_budget=8192, process_group=group)

Ranks of mesh [[0, 1, 2, 3], [4, 5, 6, 7]] (dp x tp): dp groups are [0, 4], [1, 5], [2, 6], [3, 7]; ranks 0-3 are
data-parallel rank 0 and get the same batches, ranks 4-7 are data-parallel rank 1.

With context or sequence parallelism, give the loader the mesh itself (``DynamicBatchLoader(mesh=, dp_dims=,
cp_dim= | sp_dim=)``, or accelerate's ``parallelism_config=``, found on a trainer's arguments by
[`parallelism_config_of()`][parallelism_config_of]): it builds its groups, checks that CP/SP peers hold the same batch,
emits shard-ready rows and counts the loss over the whole mesh (docs/long-context.md).
"""

from __future__ import annotations

import gc
from datetime import timedelta

import torch.distributed as dist

__all__ = ["dp_process_group", "dp_rank_groups", "destroy_process_groups", "parallelism_config_of"]


def destroy_process_groups() -> None:
    """Optional: end a job's ``torch.distributed`` use explicitly -- collect, then destroy every process group.

    A job does not need it to exit cleanly: evenflow closes its open epochs and frees its collectives' tensors
    before the interpreter finalizes (NOTE [ Exit-time teardown ] in evenflow.runtime.teardown). What it adds:
    a group nothing else holds is destroyed now, with the interpreter alive, and its worker threads are joined,
    so a collective issued by *other* code just before (a trainer's metrics, your own ``all_reduce``) is not
    still held by one when the process exits -- the exit-time abort evenflow cannot rule out for you
    (docs/failures.md, "Exit codes").
    ``gc.collect()`` first: a trainer, a DDP model or a loader in a reference cycle keeps its group alive past
    ``destroy_process_group()`` otherwise (measured on examples/hf_trainer.py: after ``main()`` returns, the
    trainer, its DDP model and both loaders are alive until a collection). No other ``torch.distributed`` call
    may follow. A no-op without an initialized process group (apart from the collection).
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def dp_rank_groups(mesh, dim: str | int) -> list[list[int]]:
    """Global ranks of every group along ``dim`` of ``mesh`` (one list per combination of the other dims).

    For a ``(dp=2, tp=2)`` mesh ``[[0, 1], [2, 3]]``: ``dp_rank_groups(mesh, "dp") == [[0, 2], [1, 3]]``.
    """
    names = mesh.mesh_dim_names
    if isinstance(dim, str):
        if not names or dim not in names:
            raise ValueError(f"mesh has no dimension named {dim!r} (names: {names}); pass the name or index of the "
                             "data-parallel dimension")
        index = names.index(dim)
    else:
        index = dim
        if not 0 <= index < mesh.ndim:
            raise ValueError(f"mesh dimension {dim} out of range for a {mesh.ndim}-D mesh")
    ranks = mesh.mesh.movedim(index, -1).reshape(-1, mesh.mesh.shape[index])
    return [[int(r) for r in row] for row in ranks.tolist()]


def dp_process_group(mesh, dim: str | int = "dp", *, timeout: timedelta = timedelta(minutes=5)):
    """A gloo group over this rank's data-parallel peers along ``dim`` (collective: call on every rank).

    Every group along ``dim`` is created (``new_subgroups_by_enumeration``, as process-group creation requires of
    every rank) and this rank's is returned. ``timeout`` bounds every metadata exchange on it; a dead peer then
    fails the job instead of hanging it.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dp_process_group needs torch.distributed to be initialized (init_process_group first)")
    groups = dp_rank_groups(mesh, dim)
    mine, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout, backend="gloo")
    return mine


def parallelism_config_of(source: object) -> object | None:
    """accelerate's ``ParallelismConfig`` of ``TrainingArguments`` / ``SFTConfig``, an ``Accelerator`` or its
    state (its ``parallelism_config`` attribute), or ``None`` where it has none; pass it to the loader as
    ``parallelism_config=``.

    >>> class Args:
    ...     parallelism_config = None
    >>> parallelism_config_of(Args()) is None
    True
    """
    config = getattr(source, "parallelism_config", None)
    if config is None:
        return None
    if not all(hasattr(config, f"{name}_size") for name in ("dp_replicate", "dp_shard", "cp", "tp")):
        raise TypeError(f"{type(source).__name__}.parallelism_config is a {type(config).__name__}, not an accelerate "
                        "ParallelismConfig (dp_replicate_size, dp_shard_size, cp_size, sp_size, tp_size)")
    return config
