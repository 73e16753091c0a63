"""What a balanced step refuses before it trains: replicas nothing synchronizes, a step some ranks skip, a
loader whose encoder budget is not the step's, a batch whose StepInfo was never taken out.

NOTE [ Replicas cannot drift silently ]
    The balanced step moves data, not gradients: averaging them over ranks is the wrapper's job (DDP, FSDP2).
    A model nothing wraps trains one replica per rank, every step on different data, and they diverge from
    the first optimizer step without a word. So [`BalancedVLM`][evenflow.vlm.BalancedVLM] refuses, on more than one
    rank, a model that shows no gradient synchronization evenflow can see ([`gradient_sync()`][gradient_sync]), unless
    told that something it cannot see does it (``VLMConfig(gradient_sync="external")``). What it can see is
    not proof (a DDP comm hook that skips the all-reduce, a ``no_sync()`` left open), so a backstop checks the
    outcome: at the step after the second optimizer step (the third call), every rank's checksum of its
    replicated parameters rides the metadata exchange, and ranks that differ are refused on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from ..step_info import STEP_INFO_KEY, LoaderTerms, StepInfo, StepInfoMisuse
from .families import unwrap_model

__all__ = ["gradient_sync", "check_gradient_sync", "replica_checksum", "check_replicas", "step_stamp",
           "check_step_stamps", "check_loader_terms", "check_not_popped", "wait_bound", "missing_call", "CHECKSUM_CALL"]

CHECKSUM_CALL = 2
"""The call (from 0) whose metadata exchange carries the parameter checksum: after two optimizer steps."""
_TOLERANCE = 1e-9
"""Relative to the parameters' absolute sum: replicas a wrapper keeps in sync are equal bit for bit."""


def gradient_sync(model: torch.nn.Module) -> str | None:
    """The gradient synchronization ``model`` shows (a name), or ``None``: DDP, FSDP (1 or 2: ``fully_shard``
    units or DTensor parameters), a DeepSpeed engine."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "DistributedDataParallel"
    if type(model).__module__.split(".")[0] == "deepspeed":
        return "DeepSpeed"
    import torch.distributed.fsdp as fsdp

    for name in ("FSDPModule", "FullyShardedDataParallel"):  # FSDP2's unit class is public from torch 2.6
        cls = getattr(fsdp, name, None)
        if isinstance(cls, type) and any(isinstance(m, cls) for m in model.modules()):
            return name
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor has no FSDP2 either
        return None
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "DTensor parameters"
    return None


def check_gradient_sync(model: torch.nn.Module, world_size: int, mode: str) -> None:
    """Refuse, on more than one rank, a model that shows no gradient synchronization (NOTE [ Replicas cannot
    drift silently ])."""
    if world_size < 2 or mode != "detect" or gradient_sync(model) is not None:
        return
    raise ValueError(
        f"BalancedVLM on {world_size} ranks got a {type(model).__name__} that shows no gradient synchronization "
        "(not DistributedDataParallel, no FSDP2 fully_shard units or DTensor parameters): every rank would train its "
        "own replica and they would drift apart from the first optimizer step. Wrap it first and pass the wrapped "
        "model: DistributedDataParallel(model) (the balanced step runs every tower on every rank, so "
        "find_unused_parameters is not needed) or FSDP2's fully_shard. If something evenflow cannot see averages "
        "the gradients (DeepSpeed, your own all-reduce, a trainer that wraps the model later and hands it to "
        "vlm(..., model=)), say so: VLMConfig(gradient_sync='external')")


def _sharded(model: torch.nn.Module) -> bool:
    name = gradient_sync(model)
    return name is not None and name not in ("DistributedDataParallel", "DeepSpeed")


def replica_checksum(model: torch.nn.Module) -> tuple[int, int]:
    """``(sum, absolute sum)`` of the parameters every rank holds whole, as float64 bits; ``(0, 0)`` when the
    parameters are sharded (FSDP: each rank holds its own part)."""
    base = unwrap_model(model)
    if _sharded(model) or _sharded(base):
        return 0, 0
    total = torch.zeros((), dtype=torch.float64)
    absolute = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for p in base.parameters():
            d = p.detach().to(torch.float64)
            total += d.sum().cpu()
            absolute += d.abs().sum().cpu()
    bits = np.array([float(total), float(absolute)], dtype=np.float64).view(np.int64)
    return int(bits[0]), int(bits[1])


def check_replicas(words: np.ndarray, rank: int) -> None:
    """Raise on every rank when the gathered checksums (``[world, 2]`` float64 bits) differ."""
    if not (words[:, 1] != 0).all():
        return
    values = words.astype(np.int64).view(np.float64)
    spread = float(np.abs(values[:, 0] - values[0, 0]).max())
    if spread <= _TOLERANCE * float(values[:, 1].max()):
        return
    r = int(np.abs(values[:, 0] - values[0, 0]).argmax())
    raise RuntimeError(
        f"evenflow: rank {rank}: the model's parameters differ across ranks after two optimizer steps (checksum "
        f"{values[0, 0]:.6g} on rank 0, {values[r, 0]:.6g} on rank {r}): nothing averaged the gradients, so each rank "
        "trained its own replica. Wrap the model in DistributedDataParallel or FSDP2's fully_shard and pass the "
        "wrapped model, and leave its gradient sync on (no comm hook that skips the all-reduce, no no_sync() outside "
        "accumulation windows); NOTE [ Replicas cannot drift silently ] in evenflow/vlm/checks.py")


def step_stamp(info: StepInfo | None) -> int:
    """The loader step a call is for (``epoch * 2**32 + step + 1``; 0 without a StepInfo)."""
    return 0 if info is None else int(info.epoch) * 2**32 + int(info.step) + 1


def check_step_stamps(stamps: np.ndarray, rank: int) -> None:
    """Raise on every rank when ranks called the step for different loader steps."""
    if not (stamps != 0).all() or (stamps == stamps[0]).all():
        return
    r = int(np.flatnonzero(stamps != stamps[0])[0])

    def what(stamp: int) -> str:
        return f"epoch {(int(stamp) - 1) >> 32} step {(int(stamp) - 1) & (2**32 - 1)}"

    raise RuntimeError(
        f"evenflow: rank {rank}: the balanced step was called for {what(stamps[0])} on rank 0 but for "
        f"{what(stamps[r])} on rank {r}: a rank skipped a call. Every rank must call vlm(batch, info) once for every "
        "batch the loader yields, IDLE ones included (no `continue` or `if rank == 0:` around the step)")


def wait_bound(terms: LoaderTerms | None) -> timedelta | None:
    """How long a step waits for its peers: half the loader's ``timeout``, so that this error reaches the
    other ranks through the loader before the loader's own wait ends; ``None`` (the group's own) without one."""
    return None if terms is None else timedelta(seconds=terms.timeout_s / 2)


def missing_call(rank: int, info: StepInfo | None, bound: timedelta) -> TimeoutError:
    where = "" if info is None else f" for epoch {info.epoch} step {info.step}"
    return TimeoutError(
        f"evenflow: rank {rank} called the balanced step{where} and waited {bound.total_seconds():g} s (half the "
        "loader's timeout) for the other ranks to call it too: not every rank called vlm(batch, info) for this "
        "batch. Every rank must call the step once for every batch the loader yields, IDLE ones included (no "
        "`if rank == 0:` or `continue` around it)")


def check_loader_terms(terms: LoaderTerms | None, max_encoder_rows: int | None) -> None:
    """Refuse a loader whose encoder budget is not the step's (before anything moves)."""
    if terms is None or terms.max_encoder_rows == max_encoder_rows:
        return
    loader = "no max_encoder_rows" if terms.max_encoder_rows is None else f"max_encoder_rows={terms.max_encoder_rows}"
    step = "no max_encoder_rows" if max_encoder_rows is None else f"max_encoder_rows={max_encoder_rows}"
    value = max_encoder_rows if terms.max_encoder_rows is None else terms.max_encoder_rows
    raise ValueError(
        f"the loader batches with {loader} but the balanced step plans with {step} (VLMConfig): balancing could pile "
        "more patch rows on a rank than its budget, and a step fails mid-training. Give both the same budget: "
        f"DynamicBatchLoader(..., max_encoder_rows={value}) and VLMConfig(max_encoder_rows={value})")


def check_not_popped(batch: Mapping[str, Any] | None) -> None:
    """A batch that still holds its StepInfo: the step was called without it."""
    if batch is not None and STEP_INFO_KEY in batch:
        raise StepInfoMisuse(
            f"the balanced step got a batch that still holds its StepInfo ({STEP_INFO_KEY!r}): take it out and pass "
            "it, `info = evenflow.pop_step_info(batch); step = vlm(batch, info)` -- the step scales the loss by it "
            "(no scale_loss on this path) and checks the batch against it")
