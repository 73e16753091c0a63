"""Evaluation with the same batching: no shuffle, every sample exactly once, no training side effects.

    loader = eval_loader(val_set, token_budget=16384)
    result = evaluate_loss(model, loader)        # collective over the loader's group: call on every rank
    result["loss"]                               # exact per-token mean over the whole set, identical on all ranks

Why a helper and not just a loader flag: an evaluation pass must (1) yield every sample once, which join mode gives,
(2) run the model on IDLE batches too -- an FSDP forward all-gathers parameters and a DDP forward may broadcast
buffers, so a rank that skipped its IDLE step would hang its peers -- and (3) weight each rank's mean loss by its
supervised tokens, not by its batch count, or long-sample ranks would be under-weighted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch.utils.data import Dataset

from ..runtime.comm import sum_over
from ..runtime.loader import DynamicBatchLoader
from ..step_info import pop_step_info

__all__ = ["eval_loader", "evaluate_loss", "model_loss"]

_FIXED = {"shuffle": False, "join": True, "grad_accum_steps": 1}


def eval_loader(dataset: Dataset, *, token_budget: int, **options) -> DynamicBatchLoader:
    """A [`DynamicBatchLoader`][DynamicBatchLoader] for evaluation: ``shuffle=False``, ``join=True``,
    ``grad_accum_steps=1``.

    Its own object and its own metadata group (construction is collective, like any loader), so evaluating never
    moves the training loader's position, epoch or state. Other options (``buffer_size``, ``num_workers``,
    ``collate_fn``, ``process_group``...) are those of [`DynamicBatchLoader`][DynamicBatchLoader].
    """
    clash = sorted(k for k in _FIXED if k in options and options[k] != _FIXED[k])
    if clash:
        raise ValueError(f"eval_loader fixes {', '.join(f'{k}={_FIXED[k]}' for k in clash)}: evaluation must see "
                         "every sample exactly once in a fixed order; build a DynamicBatchLoader directly otherwise")
    return DynamicBatchLoader(dataset, token_budget=token_budget, **{**options, **_FIXED})


def model_loss(model: torch.nn.Module, batch: Mapping) -> torch.Tensor:
    """Default forward: ``model(**batch)`` returning an HF-style output with ``.loss`` (or a loss tensor)."""
    out = model(**batch)
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return out["loss"]
    return out.loss


def evaluate_loss(model: torch.nn.Module, loader: DynamicBatchLoader, *,
                  forward: Callable[[torch.nn.Module, Mapping], torch.Tensor] = model_loss,
                  device: torch.device | str | None = None) -> dict[str, float]:
    """Exact per-token mean loss of ``model`` over one pass of ``loader`` (collective: call on every rank).

    ``forward(model, batch)`` returns the mean loss over the batch's supervised tokens (the HF convention); it is
    weighted by ``StepInfo.local_loss_tokens`` and summed over ranks with one ``all_reduce`` on the loader's gloo
    group. IDLE batches run the forward (so sharded models stay in step) and count zero. The model's training mode
    is restored afterwards; no gradient is kept.

    Returns ``{"loss", "loss_tokens", "samples", "steps", "idle_steps"}`` -- identical on every rank.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    tokens = samples = steps = idle = 0
    try:
        with torch.no_grad():
            for batch in loader:
                info = pop_step_info(batch)
                if device is not None:
                    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                loss = forward(model, batch)
                steps += 1
                tokens += info.global_loss_tokens
                samples += info.global_samples
                if info.is_idle:
                    idle += 1
                elif info.local_loss_tokens:
                    total += loss.detach().to(torch.float64).cpu() * info.local_loss_tokens
    finally:
        model.train(was_training)
    loss_sum = float(total)
    if loader.world_size > 1:  # often a job's last collective: released before it returns (NOTE [ Exit-time teardown ])
        loss_sum = sum_over(loss_sum, loader.topology.group)
    return {"loss": loss_sum / tokens if tokens else float("nan"), "loss_tokens": float(tokens),
            "samples": float(samples), "steps": float(steps), "idle_steps": float(idle)}
